"""The Gluon sm_90 attention kernels (``AttentionConfig(kernel="sm90")``, kernels A and B) on
hostile inputs against the fp32 reference (``pytest -m gpu`` on Hopper; skipped without a
CUDA device, and elsewhere than sm_90): the check ``benchmarks/gpu_attention_sm90.py`` ran.

Each case runs in its own process under a time limit (``child_process.run_in_child``): a
wrong mbarrier phase hangs a warp-specialised kernel instead of failing it, and a hung CUDA
context would take the rest of the run with it.

Every (format, h_q, T, topk, splits, ring slots, fused remap) case, on poisoned outputs: slots
that are -1, past the cache or other negatives (the kit's ``hostile_attention_indices``), an
all -1 row, the last cache row three times, a row with one valid entry (in its last column),
a row of one slot repeated, random ``topk_length`` (0 and topk included), a sink with +inf,
heads read through a stride, the last row's scores past exp's fp32 range (overflow safety of
the online softmax); a second call bit-equal to the first. With the fused remap, the positions go
through a shuffled block table with -1 pages. And ``flash_mla_sparse_fwd`` (kernel B over
pages of one row) on a hostile prefill problem, max_logits included.
"""

from __future__ import annotations

import pytest
import torch
from child_process import run_in_child
from gpu_profile import gpu_sizes

from sparse_mla.compat.flashmla import flash_mla_sparse_fwd
from sparse_mla.ops.attention import sparse_mla_decode, sparse_mla_decode_reference
from sparse_mla.ops.attention.api import sm90_available
from sparse_mla.testing import (
    attention_call_error,
    attention_error,
    hostile_attention_indices,
    max_logits_error,
    poison,
    random_mla_cache,
)
from sparse_mla.testing.sweep.attention import forced_sm90_config

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
PAGE, ROWS, SCALE = 64, 1 << 14, 0.1352
PREFILL = (300, 1 << 15, 2048, 128)  # s_q, s_kv, topk, h_q
# Compiling a variant takes seconds; a kernel that has not returned by then never will.
CASE_TIMEOUT_S = 240
CASES = [  # (h_q, T, topk, splits, ring slots, fused remap)
    (16, 7, 512, 1, 2, False), (16, 7, 512, 3, 2, False), (1, 3, 256, 2, 2, False),
    (8, 5, 320, 1, 1, False), (20, 4, 512, 2, 2, True), (32, 6, 1024, 4, 2, False),
    (32, 3, 2048, 1, 2, True), (16, 130, 2048, 2, 2, False), (13, 2, 64, 1, 2, False),
    (16, 2, 100, 1, 2, True), (64, 7, 512, 1, 2, False), (128, 3, 2048, 2, 2, True),
    (48, 5, 320, 1, 2, False), (100, 2, 1024, 4, 2, False), (64, 130, 2048, 1, 2, True),
    (128, 1, 2048, 16, 2, False),
]  # fmt: skip
PROFILES = {"full": {"cases": CASES}, "quick": {"cases": [CASES[i] for i in (1, 4, 6, 11, 14, 15)]}}
# A one-slot ring is bf16's only (decode_sm90.SHAPES).
PARAMS = [(f, c) for f in ("fp8", "bf16") for c in gpu_sizes(PROFILES)["cases"]
          if not (f == "fp8" and c[4] == 1)]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def hopper() -> None:
    if not sm90_available(DEV):
        pytest.skip("the Gluon kernels run on sm_90 only")


def hostile_call(g: torch.Generator, h: int, t: int, topk: int, fused: bool) -> dict:
    """q (strided heads; the last row scaled so its scores overflow exp in fp32) and the index
    arguments."""
    dev = g.device
    qf = torch.randn(t, h + 3, 576, device=dev, generator=g)
    qf[-1] *= 30
    q = qf.bfloat16()[:, 1 : h + 1]
    idx = hostile_attention_indices(g, t, topk, ROWS)  # row 0: last row x3, row 1: all -1
    if t > 3:  # one valid entry, in the last column
        idx[3] = -1
        idx[3, -1] = torch.randint(0, ROWS, (), device=dev, generator=g)
    if t > 4:
        idx[4] = idx[4, 0].abs() % ROWS  # one slot, topk times
    lens = torch.randint(0, topk + 1, (t,), device=dev, dtype=torch.int32, generator=g)
    lens[0] = topk
    lens[3:5] = topk
    if t > 2:
        lens[2] = 0
    sink = torch.randn(h, device=dev, generator=g)
    sink[0] = float("inf")
    call = dict(q=q, indices=idx, topk_length=lens, attn_sink=sink)
    if fused:
        reqs, width = 3, ROWS // PAGE
        bt = torch.randperm(width, device=dev, generator=g).to(torch.int32)
        bt = bt.repeat(reqs, 1).contiguous()
        bt[1, ::7] = -1
        req = torch.randint(0, reqs, (t,), device=dev, dtype=torch.int32, generator=g)
        call.update(block_table=bt, req_id=req)
    return call


def run_sm90_case(fmt: str, case: tuple, seed: int) -> str | None:
    """One case on a fresh CUDA context (the child's): None when it passes."""
    h, t, topk, splits, nbuf, fused = case
    cache = random_mla_cache(ROWS // PAGE, PAGE, fp8=fmt == "fp8", scale=0.5, device=DEV,
                             g=torch.Generator(device=DEV).manual_seed(0))  # fmt: skip
    call = hostile_call(torch.Generator(device=DEV).manual_seed(seed), h, t, topk, fused)
    q, idx = call.pop("q"), call.pop("indices")
    out = torch.empty(t, h, 512, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(t, h, device=DEV)
    poison(out, lse)
    cfg = forced_sm90_config(h, fmt, splits, nbuf)
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, out=out, lse=lse, config=cfg, **call)
    again = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg, **call)
    err = attention_call_error(q, cache, idx, out, lse, sm_scale=SCALE, **call)
    if err is None and not (torch.equal(again[0], out) and torch.equal(again[1], lse)):
        err = "a second call differs from the first"
    return err


@pytest.mark.parametrize("fmt,case", PARAMS, ids=["{}-h{}-T{}-k{}-s{}-r{}-f{:d}".format(f, *c)
                                                  for f, c in PARAMS])  # fmt: skip
def test_hostile_against_reference(fmt: str, case: tuple, seed: int):
    err = run_in_child(run_sm90_case, fmt, case, seed, timeout_s=CASE_TIMEOUT_S)
    assert err is None, err


def run_prefill_case(seed: int) -> str | None:
    """``flash_mla_sparse_fwd`` at h_q 128 (kernel B), 300 query rows, top-k 2048 of 32K rows
    with hostile ids, random lengths and a sink: out, lse (+inf for empty rows, FlashMLA's
    convention) and max_logits against the reference."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    s_q, s_kv, topk, h = PREFILL
    kv = (torch.randn(s_kv, 1, 576, device=DEV, generator=g) * 0.5).bfloat16()
    q = torch.randn(s_q, h, 576, device=DEV, generator=g).bfloat16()
    idx = hostile_attention_indices(g, s_q, topk, s_kv)[:, None]
    lens = torch.randint(0, topk + 1, (s_q,), device=DEV, dtype=torch.int32, generator=g)
    sink = torch.randn(h, device=DEV, generator=g)
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink, topk_length=lens)
    ref = sparse_mla_decode_reference(q, kv, idx[:, 0], sm_scale=SCALE, topk_length=lens,
                                      attn_sink=sink, dtype=torch.float32, chunk=4,
                                      magnitude=True, with_max=True)  # fmt: skip
    if not torch.isposinf(lse[1]).all():
        return "lse of the all -1 row is not +inf"
    ours = torch.where(torch.isposinf(lse), float("-inf"), lse)
    return attention_error(out, ours, *ref[:4]) or max_logits_error(mx, ref[4], ref[3])


def test_sparse_prefill_against_reference(seed: int):
    err = run_in_child(run_prefill_case, seed, timeout_s=CASE_TIMEOUT_S)
    assert err is None, err
