"""The KV-cache writers on a CUDA device (``pytest -m gpu``; skipped without one): the checks
``benchmarks/gpu_indexer.py`` ran before timing, as tests.

3000 tokens (one all-zero key, every 17th slot -1) into 64 pages of 64: ``write_indexer_k``
(bf16 and fp8, int32 and int64 slots) and ``write_mla_latent`` (bf16 and fp8) byte-equal to
their PyTorch references, and the stored values within the format's bound of the input.
"""

from __future__ import annotations

import pytest
import torch

from sparse_mla.ops.kv_cache import (
    dequantize_indexer_k_cache,
    dequantize_mla_cache,
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from sparse_mla.ops.kv_cache.naive import (
    flashmla_scale_reference,
    pow2_scale_reference,
    write_indexer_k_reference,
    write_mla_latent_reference,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
D, PAGE, PAGES, TOKENS = 128, 64, 64, 3000


def _slots(g: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(PAGES * PAGE, device=DEV, generator=g)[:TOKENS]
    slots[::17] = -1
    return slots


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_write_indexer_k_matches_reference_and_round_trips(fp8: bool, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = (torch.randn(TOKENS, D, device=DEV, generator=g) * 4).bfloat16()
    k[0] = 0
    slots = _slots(g)
    for sdt in (torch.int32, torch.int64):
        got = new_indexer_k_cache(PAGES, PAGE, D, fp8=fp8, device=DEV)
        want = new_indexer_k_cache(PAGES, PAGE, D, fp8=fp8, device=DEV)
        write_indexer_k(k, got, slots.to(sdt))
        write_indexer_k_reference(k, want, slots.to(sdt))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{sdt} != reference"
    keep = slots >= 0
    back = dequantize_indexer_k_cache(got).flatten(0, 1)[slots[keep]]
    x = k[keep].float()
    if fp8:
        s = pow2_scale_reference(x.abs().amax(dim=1))[:, None]
        assert bool(torch.all((back - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * s))
    else:
        assert torch.equal(back, x)


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_write_mla_latent_matches_reference_and_round_trips(fp8: bool, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    slots = _slots(g)
    kv = (torch.randn(TOKENS, 576, device=DEV, generator=g) * 2).bfloat16()
    got = new_mla_cache(PAGES, PAGE, fp8=fp8, device=DEV)
    want = new_mla_cache(PAGES, PAGE, fp8=fp8, device=DEV)
    write_mla_latent(kv[:, :512], kv[:, 512:], got, slots)
    write_mla_latent_reference(kv[:, :512], kv[:, 512:], want, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "!= reference"
    keep = slots >= 0
    back = dequantize_mla_cache(got).flatten(0, 1)[slots[keep]]
    x = kv[keep].float()
    tiles = x[:, :512].unflatten(1, (4, 128))
    s = flashmla_scale_reference(tiles.abs().amax(dim=2))[:, :, None]
    err = (back[:, :512].unflatten(1, (4, 128)) - tiles).abs()
    assert bool(torch.all(err <= 2.0**-4 * tiles.abs() + 2.0**-10 * s)), "nope part off bound"
    assert torch.equal(back[:, 512:], x[:, 512:]), "rope part not exact"
