"""torch.ops.sparse_mla: opcheck of every op, the ops equal to the public functions, and a
whole decode step under torch.compile(fullgraph=True) equal to eager."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sparse_mla import (
    AttentionConfig,
    ExpandConfig,
    TopKConfig,
    attention_workspace,
    library,
    topk_workspace,
)
from sparse_mla.dcp import global_topk_workspace, local_topk_candidates
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.decode.cases import clone_inputs, random_step
from sparse_mla.ops.decode_metadata import DecodeMetadataBuilder
from sparse_mla.testing import poison

I32, F32 = torch.int32, torch.float32
K = 16
HEADS = 4


@pytest.fixture(scope="module")
def step():
    """One tiny decode step (2 requests, bf16 caches), shared by the op cases."""
    return random_step(random.Random(1), seq_lens=[90, 70], decode_lens=[1, 1], num_heads=HEADS)


def _i32(*shape, lo=-1, hi=100):
    return torch.randint(lo, hi, shape, dtype=I32)


def _cases(step) -> dict[str, tuple]:
    """Positional arguments of each op (schema order), tiny shapes."""
    x = step.inputs
    b, w = x.block_table.shape
    bt, lens = x.block_table, x.seq_lens
    req = torch.arange(b, dtype=I32)
    idx = torch.stack([torch.randperm(int(n))[:K].sort().values for n in lens]).to(I32)
    slots = library.convert_req_index_to_global_index(req, bt, idx)
    logits = torch.randn(b, 128)
    ws = global_topk_workspace(b, k=K, dcp_size=2)
    cands = torch.stack(
        [
            local_topk_candidates(
                logits, lens // 2, k=K, dcp_size=2, dcp_rank=r, interleave=1, workspace=ws
            ).clone()
            for r in range(2)
        ]
    )
    attn_ws = attention_workspace(
        b, HEADS, K, cache_format="bf16", config=AttentionConfig(num_splits=2, block_n=16)
    )

    def out(*shape, dtype=I32):
        return torch.empty(shape, dtype=dtype)

    gws = library._gtopk_tensors(global_topk_workspace(b, k=K, dcp_size=2))
    return {
        "expand_decode_tokens": (
            lens, bt, out(3), out(3, w), out(3), out(3), [1, 2], None, None, 2, None, 1, 0, 1,
            None, None,
        ),
        "native_decode_seq_lens": (lens, out(b, 2), 2, 2, 1, 1, None, None),
        "dcp_local_seq_lens": (lens, out(b), 2, 1, 1, library._encode(ExpandConfig(), "expand"), None),  # noqa: E501
        "write_indexer_k": (x.k_idx, x.index_k_cache.clone(), x.slot_mapping),
        "write_mla_latent": (x.kv[:, :512], x.kv[:, 512:], x.kv_cache.clone(), x.slot_mapping),
        "index_logits": (
            x.q_idx, x.idx_weights, x.index_k_cache, lens, bt, out(b, 128, dtype=F32), None, None,
        ),
        "select_topk": (
            logits, lens, out(b, K), out(b), bt, req, topk_workspace(b), K, 64, None, None,
            None, library._encode(TopKConfig(), "topk"), None,
        ),
        "convert_req_index_to_global_index": (
            req, bt, idx, out(b, K), out(b), None, None, 64, None, "auto", None,
        ),
        "filter_and_convert_dcp_index": (
            req, bt, idx, out(b, K), out(b), 2, 1, 1, 64, None, True, "auto", None,
        ),
        "sparse_mla_decode": (
            x.q, x.kv_cache, slots, out(b, HEADS, 512, dtype=torch.bfloat16),
            out(b, HEADS, dtype=torch.float32), None, None, None, None, attn_ws.partial_out,
            attn_ws.partial_lse, 0.135, None,
            library._encode(AttentionConfig(num_splits=2, block_n=16), "attention"),
        ),
        "local_topk_candidates": (logits, lens // 2, gws, None, b, K, 2, 1, 1),
        "merge_topk_candidates": (cands, out(b, K), gws, b, K),
        "rescale_partial": (
            torch.randn(b, HEADS, 32), torch.randn(2, b, HEADS), out(b, HEADS, 32, dtype=F32),
            out(b, HEADS, dtype=F32), 1, "all_reduce",
        ),
    }  # fmt: skip


def test_every_op_has_a_case(step):
    assert sorted(_cases(step)) == sorted(library.OPS)
    for name in library.OPS:
        assert hasattr(torch.ops.sparse_mla, name)


@pytest.mark.parametrize("name", library.OPS)
def test_opcheck(step, name):
    args = _cases(step)[name]
    torch.library.opcheck(getattr(torch.ops.sparse_mla, name), args)


# ---- the ops give what the public functions give --------------------------------------------


def _public_calls(step) -> list[tuple[str, tuple, dict]]:
    """(name of the public function and its library adapter, args, kwargs)."""
    x = step.inputs
    b = x.block_table.shape[0]
    req = torch.arange(b, dtype=I32)
    idx = torch.stack([torch.randperm(int(n))[:K].sort().values for n in x.seq_lens]).to(I32)
    idx[0, -3:] = -1
    logits = torch.randn(b, 200)
    cfg = AttentionConfig(num_splits=2, block_n=16)
    ws = attention_workspace(b, HEADS, K, cache_format="bf16", config=cfg)
    remap = {"block_table": x.block_table, "req_id": req}
    return [
        ("expand_decode_tokens", (x.seq_lens, x.block_table, [2, 1]), {"max_decode_len": 2}),
        ("expand_decode_tokens", (x.seq_lens, x.block_table, torch.tensor([2, 1], dtype=I32)),
         {"max_decode_len": 2, "num_tokens": 5}),
        ("native_decode_seq_lens", (x.seq_lens,), {"next_n": 3, "dcp_size": 2, "dcp_rank": 1}),
        ("dcp_local_seq_lens", (x.seq_lens,), {"dcp_size": 2, "dcp_rank": 1, "interleave": 2}),
        ("index_logits", (x.q_idx, x.idx_weights, x.index_k_cache, x.seq_lens, x.block_table),
         {"max_len": 100}),
        ("select_topk", (logits, x.seq_lens), {"k": K, "return_valid_counts": True}),
        ("select_topk", (logits, x.seq_lens), {"k": K, **remap, "config": TopKConfig(row_warps=4)}),
        ("convert_req_index_to_global_index", (req, x.block_table, idx),
         {"return_valid_counts": True}),
        ("filter_and_convert_dcp_index", (req, x.block_table, idx),
         {"dcp_size": 2, "dcp_rank": 0, "return_valid_counts": True}),
        ("sparse_mla_decode", (x.q, x.kv_cache, idx), {"sm_scale": 0.1, **remap}),
        ("sparse_mla_decode", (x.q, x.kv_cache, idx),
         {"sm_scale": 0.1, **remap, "workspace": ws, "config": cfg}),
        ("local_topk_candidates", (logits, x.seq_lens),
         {"k": K, "dcp_size": 2, "dcp_rank": 1, "interleave": 1}),
    ]  # fmt: skip


def _flat(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if t is not None]


def test_ops_equal_the_public_functions(step):
    import sparse_mla
    from sparse_mla import dcp
    from sparse_mla.ops import decode_metadata

    for name, args, kwargs in _public_calls(step):
        public = getattr(sparse_mla, name, None) or getattr(dcp, name, None)
        public = public or getattr(decode_metadata, name)
        want = [t.clone() for t in _flat(public(*args, **kwargs))]
        got = _flat(getattr(library, name)(*args, **kwargs))
        assert len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g, w), name


def test_cache_writers_equal_the_public_functions(step):
    import sparse_mla

    x = step.inputs
    for name, args in [
        ("write_indexer_k", (x.k_idx, x.index_k_cache, x.slot_mapping)),
        ("write_mla_latent", (x.kv[:, :512], x.kv[:, 512:], x.kv_cache, x.slot_mapping)),
    ]:
        mine, theirs = args[-2].clone(), args[-2].clone()  # holding the history already
        getattr(sparse_mla, name)(*args[:-2], theirs, args[-1])
        assert getattr(library, name)(*args[:-2], mine, args[-1]) is mine
        assert torch.equal(mine, theirs), name


def test_configs_round_trip():
    for kind, cfg in [("topk", TopKConfig(row_warps=4)), ("attention", AttentionConfig())]:
        assert library._decode(library._encode(cfg, kind), kind) == cfg
    assert library._decode(library._encode(None, "topk"), "topk") is None
    assert library._decode("auto", "remap") == "auto"


# ---- torch.compile(fullgraph=True) of a whole decode step -----------------------------------


class _Recorder:
    """A backend that keeps the FX graphs Dynamo hands it, then runs them through AOT
    autograd (functionalisation and the fakes) without Inductor's C++ compile."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _compiled_step(plan, decode_lens, num_tokens):
    backend, warnings = _Recorder(), _Warnings()
    logger = logging.getLogger("torch._dynamo")  # triton_kernel_wrap logs here
    logger.addHandler(warnings)
    torch._dynamo.reset()
    try:
        fn = torch.compile(
            lambda x: plan.run(x, decode_lens, num_tokens=num_tokens), fullgraph=True,
            backend=backend,
        )  # fmt: skip
        yield fn
    finally:
        logger.removeHandler(warnings)
    assert len(backend.graphs) == 1, "one graph (no break)"
    targets = {str(n.target) for g in backend.graphs for n in g.graph.nodes}
    assert not any("triton" in t for t in targets), targets  # no raw Triton launch traced
    assert any("sparse_mla" in t for t in targets), targets
    assert not any("every input is mutated" in m for m in warnings.messages), warnings.messages


@pytest.mark.parametrize(
    "decode_lens, pad, remap",
    [([1, 1], 0, "topk"), ([2, 1], 1, "separate"), ([2, 2], 0, "attention")],
)
def test_decode_step_compiles_to_one_graph_equal_to_eager(rng, decode_lens, pad, remap):
    case = random_step(
        rng, seq_lens=[150, 90], decode_lens=decode_lens, num_heads=HEADS, pad_rows=pad
    )
    cfg = DecodePlanConfig(
        max_num_tokens=case.num_tokens + 1, max_num_requests=3,
        max_blocks_per_req=case.max_blocks, num_heads=HEADS, topk=K, max_decode_len=2,
        remap=remap, mla_fp8=False,
    )  # fmt: skip
    plan = DecodePlan(cfg, sm_scale=0.135)
    compiled_inputs = clone_inputs(case.inputs)
    want = plan.run(case.inputs, case.decode_lens, num_tokens=case.num_tokens)
    want = [None if t is None else t.clone() for t in want]
    poison(plan._out, plan._lse, plan._indices)
    gen = _compiled_step(plan, case.decode_lens, case.num_tokens)
    got = next(gen)(compiled_inputs)
    next(gen, None)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert torch.equal(g, w)
    assert torch.equal(compiled_inputs.kv_cache, case.inputs.kv_cache)
    assert torch.equal(compiled_inputs.index_k_cache, case.inputs.index_k_cache)


def test_builder_and_remap_compile_without_a_break(step):
    """The metadata builder (ragged: staged offsets) and a compat entry, compiled."""
    from sparse_mla.compat.vllm import triton_convert_req_index_to_global_index

    x = step.inputs
    builder = DecodeMetadataBuilder(4, 2, x.block_table.shape[1], 2)
    idx = torch.randint(-1, 60, (3, K), dtype=I32)

    def fn(seq_lens, block_table, idx):
        meta = builder.build(seq_lens, block_table, [2, 1])
        slots = triton_convert_req_index_to_global_index(
            meta.req_id, meta.block_table, idx, NUM_TOPK_TOKENS=K
        )
        return meta.seq_lens.clone(), meta.req_id.clone(), slots

    want = fn(x.seq_lens, x.block_table, idx)
    torch._dynamo.reset()
    backend = _Recorder()
    got = torch.compile(fn, fullgraph=True, backend=backend)(x.seq_lens, x.block_table, idx)
    assert len(backend.graphs) == 1
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
