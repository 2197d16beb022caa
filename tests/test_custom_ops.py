"""torch.ops.sparse_mla: opcheck of every op, the ops equal to the public functions, and a
whole decode step under torch.compile(fullgraph=True) equal to eager (AOT autograd; with
Inductor too on a GPU, gpu-marked: what ``benchmarks/gpu_custom_ops.py`` checked before it
timed). On a GPU every test here runs on CUDA tensors (opcheck included)."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from sparse_mla import AttentionConfig, TopKConfig, library
from sparse_mla._custom_op import OPS, decode_config, encode_config
from sparse_mla._runtime import default_device
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.testing import compiled_matches_eager, poison
from sparse_mla.testing.cases import (
    OP_CASE_K,
    clone_inputs,
    compile_cases,
    custom_op_cases,
    op_path_matches_public,
    public_call_cases,
    random_step,
)

I32 = torch.int32
DEV = default_device()
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


def test_ops_equal_the_public_functions(step):
    for name, args, kwargs in public_call_cases(step):
        op_path_matches_public(name, args, kwargs)


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
    from sparse_mla import ExpandConfig, IndexLogitsConfig, RemapConfig, choose_remap_config

    for cls, cfg in [
        (TopKConfig, TopKConfig(row_warps=4, fallback_side_stream=False)),
        (AttentionConfig, AttentionConfig(block_n=32, num_stages=1)),
        (ExpandConfig, ExpandConfig(store_evict="")),
        (IndexLogitsConfig, IndexLogitsConfig(block_s=32)),
        (RemapConfig, choose_remap_config(2048, count_valid=True, compact=True, num_rows=64)),
    ]:
        assert decode_config(encode_config(cfg), cls) == cfg
    assert decode_config(encode_config(None), TopKConfig) is None
    assert decode_config("auto", RemapConfig, arg="layout", auto=True) == "auto"


def test_malformed_config_strings_name_the_argument():
    """A config string an op cannot decode says which argument and what form (issue 30)."""
    from sparse_mla import RemapConfig

    for text in ("(16, 64", "[16, 64]", "(16, 64, 1, 4, 2, 8, 128, True, 'triton', 9)", "x", "1"):
        with pytest.raises(ValueError, match=r"config must be None, or the repr .*AttentionConfig"):
            decode_config(text, AttentionConfig)
    with pytest.raises(ValueError, match=r"config must be None, or .*TopKConfig"):
        decode_config("auto", TopKConfig)  # "auto" only where the argument takes it
    with pytest.raises(ValueError, match=r"layout must be None, 'auto', or .*RemapConfig"):
        decode_config("(1,", RemapConfig, arg="layout", auto=True)
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(1, 16, 512, dtype=torch.bfloat16, device=DEV)
    args = (q, torch.zeros(1, 16, 576, dtype=torch.bfloat16, device=DEV),
            torch.zeros(1, 4, dtype=torch.int32, device=DEV), 0.1, None, None, None, None, None,
            out, torch.empty(1, 16, device=DEV), None, None)  # fmt: skip
    no_extra = (None,) * 5  # no second index set (DeepSeek-V4)
    with pytest.raises(ValueError, match="config must be None"):
        torch.ops.sparse_mla.sparse_mla_decode(*args, "(16, 64.0", None, *no_extra)
    # Well-formed but wrong field values: the public function's checks name the field.
    with pytest.raises(TypeError, match="config.block_n must be an int"):
        torch.ops.sparse_mla.sparse_mla_decode(
            *args, "(16, 64.0, 1, 4, 2, 8, 128, True)", None, *no_extra
        )


# ---- every op's parameters are its public function's ----------------------------------------


def _expected_op_parameters(entry) -> list[str]:
    """The public function's parameter names in order, each replaced by the op parameters
    that represent it (``custom_op(represents=...)``)."""
    names = []
    for name in inspect.signature(entry.public).parameters:
        names.extend(entry.represents.get(name, (name,)))
    return names


@pytest.mark.parametrize("name", library.OPS)
def test_op_parameters_are_the_public_functions(name):
    """Names and order: the public function's, with the declared substitutions (so a
    parameter added, renamed or moved on one side only fails here). Defaults: the op
    declares none (the public function passes every argument), so there is one copy."""
    entry = OPS[name]
    schema = getattr(torch.ops.sparse_mla, name).default._schema
    assert [a.name for a in schema.arguments] == _expected_op_parameters(entry)
    assert not any(a.has_default_value() or a.kwarg_only for a in schema.arguments)
    public = inspect.signature(entry.public).parameters
    for public_name, op_names in entry.represents.items():
        assert public_name in public and op_names, (name, public_name)


def test_the_parameter_check_catches_drift():
    """The comparison above fails on a reordered, renamed or missing parameter."""
    from sparse_mla._custom_op import OpEntry

    def public(a, b=None, *, c=1, out=None):
        pass

    def op(a, b, c, out):
        pass

    good = OpEntry(op, public, {})
    assert list(inspect.signature(op).parameters) == _expected_op_parameters(good)
    for drifted in (lambda a, c, b, out: None, lambda a, b, k, out: None, lambda a, b, c: None):
        assert list(inspect.signature(drifted).parameters) != _expected_op_parameters(good)
    split = OpEntry(op, public, {"out": ("out_a", "out_b")})
    assert _expected_op_parameters(split) == ["a", "b", "c", "out_a", "out_b"]


# ---- torch.compile(fullgraph=True) of a whole decode step -----------------------------------

# AOT autograd here; Inductor's code generation too on a GPU (gpu-marked: it takes minutes).
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "decode_lens, pad, remap",
    [([1, 1], 0, "topk"), ([2, 1], 1, "separate"), ([2, 2], 1, "attention")],
)
def test_decode_step_compiles_to_one_graph_equal_to_eager(rng, decode_lens, pad, remap, backend):
    # On the GPU: 16 heads, fp8 caches but where the remap is separate.
    heads, fp8 = (16, remap != "separate") if backend == "inductor" else (HEADS, False)
    case = random_step(
        rng, seq_lens=[150, 90], decode_lens=decode_lens, num_heads=heads, pad_rows=pad, fp8=fp8
    )
    cfg = DecodePlanConfig(
        max_num_tokens=case.num_tokens + 1, max_num_requests=3,
        max_blocks_per_req=case.max_blocks, num_heads=heads, topk=K, max_decode_len=2,
        remap=remap, mla_fp8=fp8,
    )  # fmt: skip
    plan = DecodePlan(cfg, sm_scale=0.135)

    def step(x):  # the step's outputs and the caches it wrote
        out = plan.run(x, case.decode_lens, num_tokens=case.num_tokens)
        return (*out, x.kv_cache, x.index_k_cache)

    def fresh_inputs():
        poison(plan._out, plan._lse, plan._indices)
        return (clone_inputs(case.inputs),)

    info = compiled_matches_eager(step, fresh_inputs, backend=backend)
    assert {"write_mla_latent", "index_logits", "select_topk", "sparse_mla_decode"} <= set(
        info["ops"]
    )


@pytest.mark.parametrize(
    "name",
    [
        "builder_uniform+vllm_remap",
        "builder_ragged+vllm_remap",
        "vllm.top_k_per_row_decode",
        "flashmla.flash_mla_with_kvcache",
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_builder_and_compat_compile_to_one_graph(step, name, backend):
    """The metadata builder (ragged: staged offsets) and the compat entries, compiled."""
    fn, args = compile_cases(step)[name]
    compiled_matches_eager(fn, lambda: args, backend=backend)


def test_compile_check_fails_on_a_raw_launch(step):
    """The check is not vacuous: a kernel launched without its op (a private launcher) is
    a graph break under fullgraph here, or a traced Triton kernel on a GPU."""
    from sparse_mla.ops.decode_metadata.expand import _launch_native

    def raw(seq_lens):
        out = torch.empty(seq_lens.shape[0], 2, dtype=I32, device=seq_lens.device)
        _launch_native(seq_lens, out, None, next_n=2, dcp_size=1, dcp_rank=0, interleave=1)
        return out

    with pytest.raises((AssertionError, torch._dynamo.exc.TorchDynamoException)):
        compiled_matches_eager(raw, lambda: (step.inputs.seq_lens,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_calls_compile_with_their_collectives(step, backend):
    """global_topk and combine: their local ops and the collective in one graph (one rank
    in this process: gloo on the CPU, NCCL on a GPU)."""
    import torch.distributed as dist

    from sparse_mla import dcp

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    dev = step.inputs.seq_lens.device
    kind = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(kind, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        logits, lens = torch.randn(2, 100, device=dev), step.inputs.seq_lens.clamp(max=100)

        def topk(logits, lens):
            return dcp.global_topk(
                logits, lens, k=K, dcp_size=1, dcp_rank=0, interleave=1, group=group
            )

        info = compiled_matches_eager(topk, lambda: (logits, lens), backend=backend)
        assert info["ops"] == ["local_topk_candidates", "merge_topk_candidates"]
        out, lse = torch.randn(2, HEADS, 32, device=dev), torch.randn(2, HEADS, device=dev)
        info = compiled_matches_eager(
            lambda o, s: dcp.combine(o, s, group=group), lambda: (out, lse), backend=backend
        )
        assert info["ops"] == ["rescale_partial"]
    finally:
        dist.destroy_process_group()
