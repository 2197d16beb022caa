"""One DSA layer's decode step on a CUDA device (``pytest -m gpu``; skipped without one): the
correctness section of ``benchmarks/gpu_decode_step.py`` as tests.

``DecodePlan.run`` against ``decode_step_reference`` (``step_error``: selections may differ
only inside the tie band) on the script's shapes (fp8 and bf16 caches, ragged and uniform
decode lengths, padding rows); where the lengths are uniform and unpadded, the step captured
in one CUDA graph and replayed on fresh lengths, tables and data, without allocating.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparse_mla.decode import DecodePlan, DecodePlanConfig, decode_step_reference
from sparse_mla.testing.cases import clone_inputs, random_step, replay_error, step_error

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
TOPK, SM_SCALE = 2048, 0.135234
CASES = [  # (fp8, seq_lens, decode_lens, padding rows)
    (True, [3000, 700, 0, 129], [2, 2, 2, 2], 0),
    (False, [5000, 64], [1, 1], 0),
    (True, [4100, 0, 900], [3, 1, 2], 3),
    (True, [2500, 0, 800], [2, 2, 2], 2),  # native rows, then padding rows
]


def _plan(case, fp8: bool, reqs: int) -> DecodePlan:
    cfg = DecodePlanConfig(case.num_tokens, reqs, case.max_blocks, 16, topk=TOPK,
                           max_decode_len=4, mla_fp8=fp8)  # fmt: skip
    return DecodePlan(cfg, sm_scale=SM_SCALE)


@pytest.mark.parametrize("fp8,lens,n,pad", CASES, ids=("ragged", "bf16", "mixed", "padded"))
def test_step_against_reference(fp8, lens, n, pad, seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    case = random_step(rng, seq_lens=lens, decode_lens=n, num_heads=16, fp8=fp8,
                       pad_rows=pad, device=DEV)  # fmt: skip
    plan = _plan(case, fp8, len(lens))
    ref_in = clone_inputs(case.inputs)
    got = plan.run(case.inputs, n, num_tokens=case.num_tokens)
    ref = decode_step_reference(**ref_in._asdict(), decode_lens=n, topk=TOPK, sm_scale=SM_SCALE)
    err, _ = step_error(got, ref, case)
    assert err is None, f"{plan.attention_backend} attention: {err}"


@pytest.mark.parametrize("fp8,lens,n", [(c[0], c[1], c[2]) for c in CASES if len(set(c[2])) == 1
                                        and c[3] == 0], ids=("fp8", "bf16"))  # fmt: skip
def test_graph_replay_on_fresh_data(fp8, lens, n, seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    case = random_step(rng, seq_lens=lens, decode_lens=n, num_heads=16, fp8=fp8, device=DEV)
    plan = _plan(case, fp8, len(lens))
    plan.run(case.inputs, n, num_tokens=case.num_tokens)  # compile eagerly first, as the script
    fresh = random_step(rng, seq_lens=[v // 2 + 1 for v in lens], decode_lens=n, num_heads=16,
                        fp8=fp8, device=DEV, max_blocks=case.max_blocks,
                        num_pages=case.inputs.kv_cache.shape[0])  # fmt: skip
    plan.capture(case.inputs, n[0])
    err = replay_error(plan, case, fresh, topk=TOPK)  # new lengths, tables, data in place
    assert err is None, err
