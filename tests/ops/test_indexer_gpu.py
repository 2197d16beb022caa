"""Indexer logits at V3.2 shapes on a CUDA device (``pytest -m gpu``; skipped without one):
the checks ``benchmarks/gpu_indexer.py`` ran before timing, as tests.

64 heads x 128 dims, page 64, bf16 and fp8 caches, next_n 1..4 and 8 (two token groups of 4),
random lengths up to 4K with one full and one empty request: against the fp64 reference
within the kit's tolerance, the -inf pattern exact; and on integer-valued data native ==
flattened == reference exactly. Inputs from the kit's generator (``indexer_problem``).
"""

from __future__ import annotations

import pytest
import torch

from sparse_mla.ops.indexer import index_logits, index_logits_reference
from sparse_mla.testing import indexer_problem, logits_tolerance_scale

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
H, D, PAGE = 64, 128, 64
CHECK_REQ, CHECK_CTX = 8, 4096


def _problem(seed: int, n: int, max_ctx: int, fp8: bool, **kw):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return indexer_problem(g, CHECK_REQ, n, max_ctx, heads=H, dim=D, block_size=PAGE, fp8=fp8, **kw)


def flattened(lens: torch.Tensor, bt: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same problem as ``n`` single-token rows per request (lengths and block tables)."""
    j = torch.arange(n, device=lens.device)
    per_row = (lens.long()[:, None] - n + 1 + j).clamp_min(0).flatten().int()
    return per_row, bt.repeat_interleave(n, dim=0)


@pytest.mark.parametrize("n", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_logits_against_fp64(fp8: bool, n: int, seed: int):
    q, w, cache, lens, bt = _problem(seed, n, CHECK_CTX, fp8)
    lens[0], lens[1] = CHECK_CTX, 0
    got = index_logits(q, w, cache, lens, bt, next_n=n)
    ref = index_logits_reference(q, w, cache, lens, bt, next_n=n)
    mag = index_logits_reference(q, w, cache, lens, bt, next_n=n, magnitude=True)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "-inf pattern"
    assert not bool(torch.isnan(got).any()), "NaN in the logits"
    fin = torch.isfinite(ref)
    rel = ((got.double() - ref).abs()[fin] / mag[fin].clamp_min(1e-30)).max().item()
    tol = logits_tolerance_scale(H, D, fp8=fp8, device=DEV)
    assert rel <= tol, f"max err/mag {rel:.2e} (tol {tol:.1e})"


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_integer_data_native_flattened_reference_equal(fp8: bool, seed: int):
    n = 4
    q, w, cache, lens, bt = _problem(seed, n, CHECK_CTX // 2, fp8, integer=True)
    native = index_logits(q, w, cache, lens, bt, next_n=n)
    fl, fbt = flattened(lens, bt, n)
    flat = index_logits(q, w, cache, fl, fbt)
    ref = index_logits_reference(q, w, cache, lens, bt, next_n=n)
    assert torch.equal(native, flat), "native != flattened"
    assert torch.equal(native.double(), ref), "native != reference"


@pytest.mark.parametrize("n", (1, 4))
def test_fp8_decoded_on_the_bits_against_fp64(n: int, e4m3_bits, seed: int):
    """The path of GPUs without e4m3 (sm_80/86), compiled and run here: fp8 bytes decoded on
    the integer bits, a bf16 dot (exact products, fp32 accumulation: the bf16 tolerance);
    on integer-valued data equal to the reference exactly."""
    e4m3_bits.on()
    q, w, cache, lens, bt = _problem(seed, n, CHECK_CTX, True)
    lens[0], lens[1] = CHECK_CTX, 0
    got = index_logits(q, w, cache, lens, bt, next_n=n)
    assert e4m3_bits.flags == [True]
    ref = index_logits_reference(q, w, cache, lens, bt, next_n=n)
    mag = index_logits_reference(q, w, cache, lens, bt, next_n=n, magnitude=True)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "-inf pattern"
    fin = torch.isfinite(ref)
    rel = ((got.double() - ref).abs()[fin] / mag[fin].clamp_min(1e-30)).max().item()
    tol = logits_tolerance_scale(H, D, fp8=False, device=DEV)
    assert rel <= tol, f"max err/mag {rel:.2e} (tol {tol:.1e})"
    q, w, cache, lens, bt = _problem(seed, n, CHECK_CTX // 2, True, integer=True)
    got = index_logits(q, w, cache, lens, bt, next_n=n)
    assert torch.equal(got.double(), index_logits_reference(q, w, cache, lens, bt, next_n=n))
