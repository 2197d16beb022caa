"""Sparse MLA decode attention at engine sizes on a CUDA device (``pytest -m gpu``; skipped
without one): the checks ``benchmarks/gpu_attention.py`` ran before timing, as tests.

A 2^20-token cache per format (the kit's generator, magnitude 0.5), topk 2048.
- The default launch at every shape the script times (h_q 8-128, T 1-512; ``quick``: fewer),
  random slots with the last 100 of each row -1: the first 16 rows against the fp32
  reference within the kit's tolerance, on poisoned outputs.
- 24 query rows with the fused remap (request-local positions through a block table)
  bit-equal to remap-then-attend, with per-row lengths (one row empty) and an attention
  sink; the first 16 rows against the reference; a second call bit-equal to the first. One
  head count per head-block size (8, 32, 128), and forced splits at 16 heads.
"""

from __future__ import annotations

import pytest
import torch
from gpu_profile import gpu_sizes

from sparse_mla import convert_req_index_to_global_index
from sparse_mla.ops.attention import AttentionConfig, attention_workspace, sparse_mla_decode
from sparse_mla.testing import (
    attention_call_error,
    poison,
    random_attention_indices,
    random_mla_cache,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
TOPK, PAGE, NKV, SCALE = 2048, 64, 1 << 20, 0.1352
CHECK_ROWS, TOKENS, REQS, WIDTH = 16, 24, 4, 1024
CASES = [(8, None), (32, None), (128, None), (16, AttentionConfig(num_splits=5))]
PROFILES = {  # the shapes gpu_attention.py times (and T 256 at 128 heads)
    "full": {"shapes": [(h, t) for h in (8, 16, 32, 64, 128) for t in (1, 8, 32, 128, 512)]
             + [(128, 256)]},
    "quick": {"shapes": [(h, t) for h in (16, 128) for t in (1, 8, 128)]},
}  # fmt: skip


@pytest.fixture(scope="module")
def caches() -> dict[str, torch.Tensor]:
    """Both formats holding the same latents (seed 0)."""
    out = {}
    for fmt in ("fp8", "bf16"):
        g = torch.Generator(device=DEV).manual_seed(0)
        out[fmt] = random_mla_cache(NKV // PAGE, PAGE, fp8=fmt == "fp8", g=g, scale=0.5, device=DEV)
    return out


@pytest.mark.parametrize("heads,tokens", gpu_sizes(PROFILES)["shapes"])
@pytest.mark.parametrize("fmt", ("fp8", "bf16"))
def test_default_launch_at_the_timed_shapes(fmt, heads, tokens, caches, seed: int):
    cache = caches[fmt]
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(tokens, heads, 576, device=DEV, generator=g).bfloat16()
    idx = random_attention_indices(g, tokens, TOPK, NKV, invalid_tail=100)
    ws = attention_workspace(tokens, heads, TOPK, cache_format=fmt, device=DEV)
    out = torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=DEV)
    poison(out, lse)
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, out=out, lse=lse, workspace=ws)
    err = attention_call_error(q, cache, idx, out, lse, sm_scale=SCALE, rows=CHECK_ROWS)
    assert err is None, err


@pytest.mark.parametrize("heads,config", CASES, ids=("h8", "h32", "h128", "h16-splits5"))
@pytest.mark.parametrize("fmt", ("fp8", "bf16"))
def test_fused_lengths_sink_against_reference(fmt, heads, config, caches, seed: int):
    cache = caches[fmt]
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = TOKENS
    q = torch.randn(t, heads, 576, device=DEV, generator=g).bfloat16()
    bt = torch.randint(0, NKV // PAGE, (REQS, WIDTH), device=DEV, dtype=torch.int32, generator=g)
    req = torch.randint(0, REQS, (t,), device=DEV, dtype=torch.int32, generator=g)
    pos = torch.randint(-1, WIDTH * PAGE, (t, TOPK), device=DEV, dtype=torch.int32, generator=g)
    lens = torch.randint(0, TOPK + 1, (t,), device=DEV, dtype=torch.int32, generator=g)
    lens[0] = 0
    sink = torch.randn(heads, device=DEV, generator=g)
    slots = convert_req_index_to_global_index(req, bt, pos, block_size=PAGE)
    kw = dict(sm_scale=SCALE, topk_length=lens, attn_sink=sink, config=config)
    two = sparse_mla_decode(q, cache, slots, **kw)
    fused = sparse_mla_decode(q, cache, pos, block_table=bt, req_id=req, block_size=PAGE, **kw)
    assert torch.equal(two[0], fused[0]) and torch.equal(two[1], fused[1]), "fused != two-step"
    err = attention_call_error(q, cache, slots, *two, sm_scale=SCALE, rows=CHECK_ROWS,
                               topk_length=lens, attn_sink=sink)  # fmt: skip
    assert err is None, err
    again = sparse_mla_decode(q, cache, slots, **kw)
    assert torch.equal(again[0], two[0]) and torch.equal(again[1], two[1]), "not deterministic"


@pytest.mark.parametrize("config", (AttentionConfig(num_splits=1), AttentionConfig(num_splits=5)),
                         ids=("unsplit", "splits5"))  # fmt: skip
def test_fp8_decoded_on_the_bits_equals_triton_conversion(config, caches, e4m3_bits, seed: int):
    """The e4m3 decode that GPUs without e4m3 (sm_80/86) run, compiled and run here: the
    same values as the hardware conversion, so the same outputs bit for bit."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(TOKENS, 16, 576, device=DEV, generator=g).bfloat16()
    slots = torch.randint(-1, NKV, (TOKENS, TOPK), device=DEV, dtype=torch.int32, generator=g)
    native = sparse_mla_decode(q, caches["fp8"], slots, sm_scale=SCALE, config=config)
    e4m3_bits.on()
    bits = sparse_mla_decode(q, caches["fp8"], slots, sm_scale=SCALE, config=config)
    assert True in e4m3_bits.flags and False not in e4m3_bits.flags
    assert torch.equal(native[0], bits[0]) and torch.equal(native[1], bits[1])
