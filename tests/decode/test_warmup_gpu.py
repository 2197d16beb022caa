"""After ``sparse_mla.warmup``, an engine's step of the same configuration compiles nothing
(``pytest -m gpu tests/decode/test_warmup_gpu.py``; skipped without a CUDA device)."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

import sparse_mla
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.decode.warmup import _counting_compiles
from sparse_mla.testing.cases import random_step

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
MAX_SEQ_LEN, PAGE = 8192, 64


@triton.jit
def _store_constant(x_ptr, VALUE: tl.constexpr):
    tl.store(x_ptr, VALUE)


def test_the_compile_counter_counts(seed: int):
    """The zeros below can fail: a launch with a constexpr never seen before is counted."""
    x = torch.zeros(1, device=DEV, dtype=torch.int32)
    with _counting_compiles() as count:
        _store_constant[(1,)](x, VALUE=seed)
        _store_constant[(1,)](x, VALUE=seed)  # in Triton's memory now
    assert count() == 1 and int(x) == seed


@pytest.mark.parametrize("fmt, n, heads", [("fp8", 1, 128), ("bf16", 2, 16), ("fp8", 2, 64)])
def test_a_step_after_warmup_compiles_nothing(fmt: str, n: int, heads: int, seed: int):
    counts = (n, 8 * n, 64 * n)
    report = sparse_mla.warmup(num_heads=heads, cache_format=fmt, max_seq_len=MAX_SEQ_LEN,
                               token_counts=counts, decode_len=n, ragged=n > 1)  # fmt: skip
    print(report.summary())
    assert report.mode == "cuda" and report.compiled is not None
    assert report.again_compiled == 0
    cfg = DecodePlanConfig(max(counts), max(counts) // n, MAX_SEQ_LEN // PAGE, heads,
                           max_decode_len=n, block_size=PAGE, mla_fp8=fmt == "fp8")  # fmt: skip
    rng = random.Random(seed)
    for rows in counts:  # an engine's steps: random data and lengths, eager and in a graph
        b = rows // n
        case = random_step(rng, seq_lens=[rng.randint(n, MAX_SEQ_LEN) for _ in range(b)],
                           decode_lens=[n] * b, num_heads=heads, fp8=fmt == "fp8",
                           max_blocks=MAX_SEQ_LEN // PAGE, device=DEV)  # fmt: skip
        plan = DecodePlan(cfg, sm_scale=0.1)
        slots64 = case.inputs._replace(slot_mapping=case.inputs.slot_mapping.long())
        with _counting_compiles() as count:
            plan.run(case.inputs, case.decode_lens)
            plan.run(slots64, case.decode_lens)  # as vLLM and SGLang hand slots out
            plan.capture(case.inputs, n)
            plan.replay()
            torch.cuda.synchronize()
        assert count() == 0, f"T = {rows}: {count()} kernels compiled after the warm-up"
