"""``V4DecodePlan`` on a CUDA device at V4-Flash layer shapes (``pytest -m gpu``; skipped
without one): 64 heads, window 128, top-k 512, CSA rate 4, HCA rate 128, 64 indexer heads,
MODEL1 fp8 caches and the fp8 indexer cache; B 1 (8K context, one row), B 32 (two MTP rows
each, contexts up to 4K) and a ragged step with a padding row; eagerly and as one CUDA graph
replayed on fresh rows without allocating; against ``v4_decode_step_reference`` (float64)
from identical random states, by the kit's ``v4_step_error`` (top-k sets equal up to ties,
out / lse within the attention tolerances)."""

from __future__ import annotations

import pytest
import torch

from sparse_mla.decode.v4_naive import V4StepInputs
from sparse_mla.testing import cuda_allocations, poison
from sparse_mla.testing.v4_step import RandomV4Layer, V4Shapes, v4_step_error

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
RATES = {"sliding": 1, "csa": 4, "hca": 128}
CASES = [(1, [8191], [1], 0), (32, None, [2] * 32, 0), (3, [3000, 700, 129], [2, 1, 2], 1)]


def _setup(kind, b, before, rows, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    if before is None:
        before = torch.randint(140, 4096, (b,), generator=gen).tolist()
    layer = RandomV4Layer(V4Shapes(kind, compress_rate=RATES[kind]), before, gen, DEV)
    lens = [n + r for n, r in zip(before, rows, strict=True)]
    x = layer.inputs(lens, rows, pad)
    return layer, lens, x, layer.plan(x.q.shape[0], b)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b,before,rows,pad", CASES, ids=["b1", "b32-mtp2", "ragged"])
def test_eager_step_against_reference(kind, b, before, rows, pad):
    layer, _, x, plan = _setup(kind, b, before, rows, pad, seed=11)
    ref, window, cmp, idx = layer.reference(x)
    poison(plan._out, plan._lse)
    got = plan.run(x, compressor=layer.cmp, indexer=layer.idx)
    torch.cuda.synchronize()
    err = v4_step_error(layer, x, got, ref, window, cmp, idx)
    assert err is None, f"{kind}: {err}"


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b,before,rows,pad", CASES, ids=["b1", "b32-mtp2", "ragged"])
def test_graph_replay_on_fresh_rows(kind, b, before, rows, pad):
    layer, lens, x, plan = _setup(kind, b, before, rows, pad, seed=12)
    plan.capture(x, compressor=layer.cmp, indexer=layer.idx)
    nxt = [n + r for n, r in zip(lens, rows, strict=True)]  # the next step: fresh rows
    fresh = layer.inputs(nxt, rows, pad)
    for name in V4StepInputs._fields:
        a, f = getattr(x, name), getattr(fresh, name)
        if a is not None and a.data_ptr() != f.data_ptr():
            a.copy_(f)
    ref, window, cmp, idx = layer.reference(x)
    poison(plan._out, plan._lse)
    got, allocs = cuda_allocations(plan.replay)
    err = v4_step_error(layer, x, got, ref, window, cmp, idx)
    assert err is None, f"{kind}: {err}"
    assert allocs == 0, f"{allocs} allocations during replay"
