"""Decode-metadata expansion at engine sizes on a CUDA device (``pytest -m gpu``; skipped
without one): the sweep that ``benchmarks/gpu_decode_metadata.py`` ran (gone: it had no timing).

The Triton kernels against the PyTorch references on larger random inputs (B up to 512, n up
to 8, W = 2048, DCP up to 8 ranks), hostile device decode lengths, CUDA-graph replay on new
data, and the builder's allocation-free path. Outputs poisoned first, compared bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparse_mla.ops.decode_metadata import (
    DecodeMetadataBuilder,
    ExpandedDecodeTokens,
    dcp_local_seq_lens,
    expand_decode_tokens,
    native_decode_seq_lens,
)
from sparse_mla.ops.decode_metadata.naive import (
    dcp_local_seq_lens_reference,
    expand_decode_tokens_reference,
    expand_decode_tokens_torch_ops,
    native_decode_seq_lens_reference,
)
from sparse_mla.testing import POISON, block_table_view, expansion_decode_lens, expansion_inputs

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
W = 2048
EXPAND_CONFIGS = [
    (num_reqs, max_n, mode)
    for num_reqs in (1, 7, 64, 512)
    for max_n in (1, 2, 3, 4, 8)
    for mode in ("uniform", "ragged", "device", "forced_ragged")
]


def assert_same(got: ExpandedDecodeTokens, want: ExpandedDecodeTokens) -> None:
    for field in ExpandedDecodeTokens._fields:
        g, w = getattr(got, field), getattr(want, field)
        assert g.shape == w.shape, f"{field} shape {tuple(g.shape)} != {tuple(w.shape)}"
        bad = (g != w.to(g.device)).nonzero()[:3].tolist()
        assert not bad, f"{field} differs at {bad}"


def poisoned(num_tokens: int, width: int) -> ExpandedDecodeTokens:
    def vec() -> torch.Tensor:
        return torch.full((num_tokens,), POISON, dtype=torch.int32, device=DEV)

    bt = torch.full((num_tokens, width + 64), POISON, dtype=torch.int32, device=DEV)[:, :width]
    return ExpandedDecodeTokens(vec(), bt, vec(), vec())


def block_table(num_reqs: int, layout: str) -> torch.Tensor:
    """Random page ids, contiguous or as a view (the kit's ``block_table_view``)."""
    vals = torch.randint(0, 1 << 24, (num_reqs, W), dtype=torch.int32, device=DEV)
    return block_table_view(vals, layout, device=DEV)


@pytest.mark.parametrize("idx", range(len(EXPAND_CONFIGS)))
def test_expand_against_references(idx: int, rng: random.Random):
    num_reqs, max_n, mode = EXPAND_CONFIGS[idx]
    kind = "uniform" if mode == "uniform" else "ragged"
    host = expansion_decode_lens(None, num_reqs, max_n, kind, decode_len=rng.randint(1, max_n))
    x = expansion_inputs(
        None, host, width=W, max_decode_len=max_n, seq_lens="near_decode_len", ctx=131072,
        layout=("contiguous", "wide_rows", "column_step")[idx % 3], device=DEV,
    )  # fmt: skip
    seq_lens, bt = x.seq_lens, x.block_table
    dcp_size, interleave = rng.choice([(1, 1), (2, 1), (2, 64), (4, 1), (4, 16), (8, 64)])
    dcp = {"dcp_size": dcp_size, "dcp_rank": rng.randrange(dcp_size), "interleave": interleave}
    num_tokens = sum(host) + rng.choice([0, 1, 37])
    kwargs: dict = {"max_decode_len": max_n, "num_tokens": num_tokens, **dcp}
    dl: object = host[0] if mode == "uniform" else host
    if mode == "device":
        dl = torch.tensor(host, dtype=torch.int32, device=DEV)
    if mode == "forced_ragged":
        kwargs["uniform"] = False
    got = expand_decode_tokens(seq_lens, bt, dl, out=poisoned(num_tokens, W), **kwargs)
    want = expand_decode_tokens_torch_ops(seq_lens, bt, host, num_tokens=num_tokens, **dcp)
    assert_same(got, want)
    if num_reqs <= 64 or idx % 7 == 0:  # the loop reference is slow at W=2048: a subset
        ref = expand_decode_tokens_reference(seq_lens, bt, host, num_tokens=num_tokens, **dcp)
        assert_same(got, ref)


@pytest.mark.parametrize("trial", range(6))
def test_hostile_device_decode_lens(trial: int, rng: random.Random):
    num_reqs, max_n = rng.choice([5, 100, 512]), 4
    host = expansion_decode_lens(None, num_reqs, max_n, "hostile")
    x = expansion_inputs(
        None, host, width=W, max_decode_len=max_n, seq_lens="hostile", layout="wide_rows",
        device=DEV,
    )  # fmt: skip
    seq_lens, bt = x.seq_lens, x.block_table
    num_tokens = rng.randint(0, num_reqs * max_n)
    kw = dict(max_decode_len=max_n, num_tokens=num_tokens)
    dl = torch.tensor(host, dtype=torch.int32, device=DEV)
    got = expand_decode_tokens(seq_lens, bt, dl, **kw, out=poisoned(num_tokens, W))
    assert_same(got, expand_decode_tokens_reference(seq_lens, bt, host, **kw))


@pytest.mark.parametrize("next_n", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("num_reqs", (1, 33, 512))
def test_native_seq_lens(num_reqs: int, next_n: int, rng: random.Random):
    seq_lens = torch.randint(-2, 131072, (num_reqs,), dtype=torch.int32, device=DEV)
    dcp_size, interleave = rng.choice([(1, 1), (2, 1), (4, 64)])
    dcp = {"dcp_size": dcp_size, "dcp_rank": rng.randrange(dcp_size), "interleave": interleave}
    out = torch.full((next_n, num_reqs), POISON, dtype=torch.int32, device=DEV).t()
    got = native_decode_seq_lens(seq_lens, next_n=next_n, out=out, **dcp)
    assert torch.equal(got, native_decode_seq_lens_reference(seq_lens, next_n=next_n, **dcp))


@pytest.mark.parametrize("dcp_size,interleave", ((2, 1), (2, 64), (4, 1), (4, 16), (8, 64)))
def test_dcp_local_seq_lens_sum_to_the_whole(dcp_size: int, interleave: int):
    seq_lens = torch.randint(-5, 1 << 20, (5000,), dtype=torch.int32, device=DEV)
    total = torch.zeros_like(seq_lens)
    for rank in range(dcp_size):
        kw = dict(dcp_size=dcp_size, dcp_rank=rank, interleave=interleave)
        got = dcp_local_seq_lens(seq_lens, **kw)
        assert torch.equal(got, dcp_local_seq_lens_reference(seq_lens, **kw)), f"rank {rank}"
        total += got
    assert torch.equal(total, seq_lens.clamp_min(0))


def test_cuda_graph_replay_of_ragged_expand(rng: random.Random):
    # One ragged expansion with device decode_lens captured, replayed on new data.
    num_reqs, max_n, num_tokens = 256, 4, 256 * 4
    seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=DEV)
    dl = torch.zeros(num_reqs, dtype=torch.int32, device=DEV)
    bt = torch.zeros(num_reqs, W, dtype=torch.int32, device=DEV)
    out = poisoned(num_tokens, W)
    dcp = dict(dcp_size=2, dcp_rank=1, interleave=64)
    kwargs = dict(max_decode_len=max_n, num_tokens=num_tokens, out=out, **dcp)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        expand_decode_tokens(seq_lens, bt, dl, **kwargs)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand_decode_tokens(seq_lens, bt, dl, **kwargs)
    for _ in range(3):
        host = [rng.randint(0, max_n) for _ in range(num_reqs)]
        seq_lens.copy_(torch.randint(0, 100000, (num_reqs,), dtype=torch.int32))
        dl.copy_(torch.tensor(host, dtype=torch.int32))
        bt.copy_(torch.randint(0, 1 << 24, (num_reqs, W), dtype=torch.int32))
        out.seq_lens.fill_(POISON)
        graph.replay()
        want = expand_decode_tokens_torch_ops(seq_lens, bt, host, num_tokens=num_tokens, **dcp)
        assert_same(out, want)


@pytest.mark.parametrize("case", ("native", "uniform", "ragged"))
def test_builder_results_stable_views_no_allocation(case: str, rng: random.Random):
    builder = DecodeMetadataBuilder(
        4096, 512, W, 8, native_decode_lens=(1, 2), dcp_size=2, dcp_rank=0, interleave=64
    )
    seq_lens = torch.randint(0, 131072, (512,), dtype=torch.int32, device=DEV)
    bt = block_table(512, "contiguous")
    host = {
        "native": [2] * 512,
        "uniform": [4] * 512,
        "ragged": [rng.randint(0, 8) for _ in range(512)],
    }[case]
    dcp = {"dcp_size": 2, "dcp_rank": 0, "interleave": 64}
    for dl in (host, torch.tensor(host, dtype=torch.int32)):
        builder.build(seq_lens, bt, dl, num_tokens=4096)  # warm up: compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    m = builder.build(seq_lens, bt, torch.tensor(host, dtype=torch.int32), num_tokens=4096)
    ptr = m.seq_lens.data_ptr()
    for _ in range(3):
        m = builder.build(seq_lens, bt, host, num_tokens=4096)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "the builder allocated"
    assert m.seq_lens.data_ptr() == ptr, "the builder's views moved"
    if m.flattened:
        want = expand_decode_tokens_torch_ops(seq_lens, bt, host, num_tokens=4096, **dcp)
        assert_same(ExpandedDecodeTokens(m.seq_lens, m.block_table, m.decode_lens, m.req_id), want)
        assert m.requires_padding == (case == "ragged")
    else:
        assert torch.equal(m.seq_lens, native_decode_seq_lens_reference(seq_lens, next_n=2, **dcp))
        assert m.next_n == 2
