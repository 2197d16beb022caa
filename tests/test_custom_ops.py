"""torch.ops.sparse_mla: opcheck of every op, the ops equal to the public functions, and a
whole decode step under torch.compile(fullgraph=True) equal to eager."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sparse_mla import AttentionConfig, TopKConfig, library
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.decode.cases import (
    OP_CASE_K,
    clone_inputs,
    compile_cases,
    custom_op_cases,
    public_call_cases,
    public_function,
    random_step,
)
from sparse_mla.testing import poison

I32 = torch.int32
K = OP_CASE_K
HEADS = 4


@pytest.fixture(scope="module")
def step():
    """One tiny decode step (2 requests, bf16 caches), shared by the op cases."""
    return random_step(random.Random(1), seq_lens=[90, 70], decode_lens=[1, 1], num_heads=HEADS)


def test_every_op_has_a_case(step):
    assert sorted(custom_op_cases(step)) == sorted(library.OPS)
    for name in library.OPS:
        assert hasattr(torch.ops.sparse_mla, name)


@pytest.mark.parametrize("name", library.OPS)
def test_opcheck(step, name):
    args = custom_op_cases(step)[name]
    torch.library.opcheck(getattr(torch.ops.sparse_mla, name), args)


# ---- the ops give what the public functions give --------------------------------------------


def _flat(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if t is not None]


def test_ops_equal_the_public_functions(step):
    for name, args, kwargs in public_call_cases(step):
        want = [t.clone() for t in _flat(public_function(name)(*args, **kwargs))]
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


@pytest.mark.parametrize(
    "name",
    [
        "builder_uniform+vllm_remap",
        "builder_ragged+vllm_remap",
        "vllm.top_k_per_row_decode",
        "flashmla.flash_mla_with_kvcache",
    ],
)
def test_builder_and_compat_compile_to_one_graph(step, name):
    """The metadata builder (ragged: staged offsets) and the compat entries, compiled."""
    fn, args = compile_cases(step)[name]
    want = [t.clone() for t in fn(*args)]
    torch._dynamo.reset()
    backend = _Recorder()
    got = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    assert len(backend.graphs) == 1
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
