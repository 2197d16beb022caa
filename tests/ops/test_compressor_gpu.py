"""DeepSeek-V4's compressors on a CUDA device (``pytest -m gpu``; skipped without one): the
V4-Flash compressors (CSA and HCA into MODEL1 fp8, the indexer's into its fp8 format) for
batches up to 128 requests of MTP 4, several steps with rejected drafts and padding, against
the float64 reference (the interpreter tests' checks); and one CUDA graph replayed over
steps, equal to the reference and allocating nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_profile import gpu_sizes

from sparse_mla.testing import cuda_allocations
from sparse_mla.testing.compressor import (
    V4_SPECS,
    check_compressor_step,
    compressor_problem,
    compressor_step_inputs,
    random_accepted,
    random_decode_lens,
    run_compressor_step,
    same_layout,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SIZES = gpu_sizes({
    "full": dict(requests=(1, 32, 128), steps=4),
    "quick": dict(requests=(32,), steps=2),
})  # fmt: skip
ENTRIES = {"csa": 1024, "indexer": 1024, "hca": 64}  # 4K positions (CSA), 8K (HCA)


def _spec(name: str, requests: int, **kw):
    return dataclasses.replace(V4_SPECS[name], requests=requests, max_decode_len=4, page=64,
                               max_entries=ENTRIES[name], **kw)  # fmt: skip


@pytest.mark.parametrize("requests", SIZES["requests"])
@pytest.mark.parametrize("name", sorted(V4_SPECS))
def test_v4_compressors_match_reference(name: str, requests: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    spec = _spec(name, requests, hostile=seed % 2 == 1)
    problem = compressor_problem(g, spec, DEV)
    for s in range(SIZES["steps"]):
        lens = random_decode_lens(g, spec)
        step = compressor_step_inputs(g, problem, lens, uniform=s == 1, extra_rows=s % 2,
                                      strided=s % 2 == 0)  # fmt: skip
        err = check_compressor_step(problem, step, random_accepted(g, step.decode_lens))
        assert err is None, f"step {s}: {err}"


def _capture(graph: torch.cuda.CUDAGraph, fn) -> None:
    with torch.cuda.graph(graph):
        fn()


@pytest.mark.parametrize("name", sorted(V4_SPECS))
def test_one_cuda_graph_replays_every_step(name: str, seed: int):
    """Captured once with decode_len 4 (every request at MTP 4): each replay reads the step
    rows and lengths refilled in place, closes whatever windows close, and matches the
    reference. The launch allocates nothing while captured (beyond what capturing an empty
    graph costs PyTorch itself) and nothing on replay."""
    g = torch.Generator().manual_seed(seed)
    spec = _spec(name, 16)
    problem = compressor_problem(g, spec, DEV)
    step = compressor_step_inputs(g, problem, [4], uniform=True)
    # A copy with the same strides: the same compiled kernel and host plan.
    cache = same_layout(problem.cache, problem.cache_base.clone())
    state = type(problem.state)(*(t.clone() for t in problem.state))
    run_compressor_step(dataclasses.replace(problem, state=state, cache=cache), step)
    _, empty = cuda_allocations(lambda: _capture(torch.cuda.CUDAGraph(), lambda: None))
    graph = torch.cuda.CUDAGraph()
    _, captured = cuda_allocations(
        lambda: _capture(graph, lambda: run_compressor_step(problem, step))
    )  # fmt: skip
    assert captured == empty, f"capture: {captured} allocations, an empty capture {empty}"
    replays: list[int] = []
    for _ in range(6):
        fresh = compressor_step_inputs(g, problem, [4], uniform=True)
        for name_, t in (("kv", step.kv), ("gate", step.gate), ("seq_lens", step.seq_lens)):
            t.copy_(getattr(fresh, name_))
        err = check_compressor_step(
            problem, step, fn=lambda *a, **k: replays.append(cuda_allocations(graph.replay)[1])
        )  # fmt: skip
        assert err is None, err
    assert replays == [0] * 6, f"allocations during replays: {replays}"
