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


@pytest.mark.parametrize("name", sorted(V4_SPECS))
def test_one_cuda_graph_replays_every_step(name: str, seed: int):
    """Captured once with decode_len 4 (every request at MTP 4): each replay reads the step
    rows and lengths refilled in place, closes whatever windows close, and matches the
    reference; no device memory is allocated by capture or replay."""
    g = torch.Generator().manual_seed(seed)
    spec = _spec(name, 16)
    problem = compressor_problem(g, spec, DEV)
    step = compressor_step_inputs(g, problem, [4], uniform=True)
    # A copy with the same strides: the same compiled kernel and host plan.
    cache = same_layout(problem.cache, problem.cache_base.clone())
    state = type(problem.state)(*(t.clone() for t in problem.state))
    # Compiles the kernel and creates whatever the check itself keeps (before is measured after).
    warm = dataclasses.replace(problem, state=state, cache=cache)
    assert check_compressor_step(warm, step) is None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        run_compressor_step(problem, step)
    assert torch.cuda.memory_allocated() == before, "capture allocated"
    for _ in range(6):
        fresh = compressor_step_inputs(g, problem, [4], uniform=True)
        for name_, t in (("kv", step.kv), ("gate", step.gate), ("seq_lens", step.seq_lens)):
            t.copy_(getattr(fresh, name_))
        del fresh  # its device tensors would count as allocated below
        err = check_compressor_step(problem, step, fn=lambda *a, **k: graph.replay())
        assert err is None, err
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "replays allocated"
