"""Random decode steps (inputs + filled caches) for the tests, ``verify`` and the benchmarks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._runtime import canonical_device
from ..decode.plan import LATENT_DIM, DecodeInputs, DecodePlan
from ..ops.indexer import quantize_index_q
from ..ops.kv_cache import new_indexer_k_cache, new_mla_cache, write_indexer_k, write_mla_latent
from .checks import cuda_allocations

INDEX_HEADS, INDEX_DIM = 64, 128


@dataclass
class StepCase:
    """A step's inputs plus what the plan is told on the host."""

    inputs: DecodeInputs
    decode_lens: list[int]
    num_tokens: int
    max_blocks: int


def random_step(
    rng: random.Random,
    *,
    seq_lens: Sequence[int],
    decode_lens: Sequence[int],
    num_heads: int,
    block_size: int = 64,
    fp8: bool = False,
    pad_rows: int = 0,
    max_blocks: int | None = None,
    spare_pages: int = 3,
    num_pages: int | None = None,
    device: torch.device | str | None = None,
) -> StepCase:
    """A step over requests of total lengths ``seq_lens`` with ``decode_lens`` new tokens each.

    Past tokens (positions ``< L_b - n_b``) are already in both caches; the new ones are in
    the inputs with their slots. Pages are shuffled over the pool (a random block table).
    ``pad_rows`` extra rows with slot -1 stand for CUDA-graph padding (after every request's
    rows, whether the plan flattens them or keeps the native layout).
    The page pool has ``spare_pages`` pages more than needed, or ``num_pages`` in all (to
    match another case's cache shapes).
    """
    dev = canonical_device(device)
    b = len(seq_lens)
    pages_per_req = [-(-max(n, 1) // block_size) for n in seq_lens]
    width = max_blocks if max_blocks is not None else max(pages_per_req, default=1)
    if num_pages is None:
        num_pages = sum(pages_per_req) + spare_pages
    if num_pages < sum(pages_per_req):
        raise ValueError(f"num_pages={num_pages} < the {sum(pages_per_req)} pages needed")
    perm = list(range(num_pages))
    rng.shuffle(perm)
    bt = torch.zeros(b, width, dtype=torch.int32)
    used = 0
    for r, p in enumerate(pages_per_req):
        bt[r, :p] = torch.tensor(perm[used : used + p], dtype=torch.int32)
        used += p
    idx_cache = new_indexer_k_cache(num_pages, block_size, fp8=fp8, device=dev)
    kv_cache = new_mla_cache(num_pages, block_size, fp8=fp8, device=dev)

    def slots_of(r: int, positions: range) -> list[int]:
        return [int(bt[r, p // block_size]) * block_size + p % block_size if p >= 0 else -1
                for p in positions]  # fmt: skip

    past, new = [], []
    for r, (length, n) in enumerate(zip(seq_lens, decode_lens, strict=True)):
        past += slots_of(r, range(max(length - n, 0)))
        new += slots_of(r, range(length - n, length))
    if past:  # fill the history with the library writers (fast, and quantised alike)
        s = torch.tensor(past, dtype=torch.int32, device=dev)
        write_indexer_k(torch.randn(len(past), INDEX_DIM, device=dev).bfloat16(), idx_cache, s)
        kv = torch.randn(len(past), LATENT_DIM, device=dev).bfloat16()
        write_mla_latent(kv[:, :512], kv[:, 512:], kv_cache, s)
    t = sum(decode_lens) + pad_rows
    slot_mapping = torch.tensor(new + [-1] * pad_rows, dtype=torch.int32, device=dev)
    q_idx = torch.randn(t, INDEX_HEADS, INDEX_DIM, device=dev).bfloat16()
    weights = torch.randn(t, INDEX_HEADS, device=dev) * (INDEX_HEADS * INDEX_DIM) ** -0.5
    if fp8:
        q_idx, weights = quantize_index_q(q_idx.float(), weights)
    inputs = DecodeInputs(
        q_idx=q_idx,
        idx_weights=weights,
        k_idx=torch.randn(t, INDEX_DIM, device=dev).bfloat16(),
        q=torch.randn(t, num_heads, LATENT_DIM, device=dev).bfloat16(),
        kv=torch.randn(t, LATENT_DIM, device=dev).bfloat16(),
        slot_mapping=slot_mapping,
        index_k_cache=idx_cache,
        kv_cache=kv_cache,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=dev),
        block_table=bt.to(dev),
    )
    return StepCase(inputs, list(decode_lens), t, width)


def clone_inputs(x: DecodeInputs) -> DecodeInputs:
    """A deep copy (caches included), so a reference can write its own caches."""
    return DecodeInputs(*(t.clone() for t in x))


# Tolerances of the step against its fp32/fp64 reference (see step_error).
OUT_ATOL, OUT_RTOL = 3e-2, 2e-2  # bf16 output (8 mantissa bits) of a convex mix of bf16 values
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4  # fp32 softmax denominator, summation order only


def tie_band(ref, t: int, positions: Sequence[int], kth: int, *, scale: float) -> float:
    """How far from the k-th best score (position ``kth``) of row ``t`` a selection may
    differ: twice the largest logits tolerance (``scale * magnitude``, the testing kit's
    :func:`~sparse_mla.testing.logits_tolerance`) among the positions involved. Each computed
    logit is within its tolerance of the reference, so two positions whose reference scores
    are that close may swap places across the k-th; farther apart, a swap is a bug."""
    mag = ref.magnitudes[t]
    return 2.0 * scale * max(mag[p].item() for p in [*positions, kth])


def step_error(
    result, ref, case: StepCase, *, block_size: int = 64, device: torch.device | None = None
) -> tuple[str | None, int]:
    """Why a :class:`~sparse_mla.decode.DecodeStepOutput` disagrees with its
    :class:`~sparse_mla.decode.naive.StepReference` (None when it agrees), and how many rows
    chose a different top-k set on a near-tie (those rows' out / lse are not compared).

    Selection: per row, the attended slots (mapped back to positions) must equal the
    reference's top-k set, except for positions whose reference score lies within
    :func:`tie_band` of the row's k-th best score: the stated tolerance of the indexer
    logits (:func:`sparse_mla.testing.logits_tolerance_scale`) on ``device``, the device that
    computed them (default ``result.out``'s; fp8 caches on CUDA have the widest). Attention:
    ``OUT_*`` / ``LSE_*`` tolerances, the ``-inf`` lse pattern exactly, no NaN.
    """
    from ..decode.naive import row_layout
    from .checks import logits_tolerance_scale

    x = case.inputs
    req, vis = row_layout(x.seq_lens.cpu(), case.decode_lens, case.num_tokens)
    scale = logits_tolerance_scale(
        x.q_idx.shape[1], x.q_idx.shape[2], fp8=x.index_k_cache.dtype == torch.uint8,
        device=result.out.device if device is None else device,
    )  # fmt: skip
    bt = x.block_table.long().cpu()
    got_slots = None if result.indices is None else result.indices.long().cpu()
    ties, compare = 0, []
    for t in range(case.num_tokens):
        want = set(ref.positions[t][ref.positions[t] >= 0].tolist())
        if got_slots is None:  # the attention remapped: the positions are what it attended
            got = set(result.positions[t][result.positions[t] >= 0].long().tolist())
        elif req[t] < 0:
            got = set()
        else:
            slot_pos = {int(bt[req[t], p // block_size]) * block_size + p % block_size: p
                        for p in range(vis[t])}  # fmt: skip
            got = {slot_pos.get(s, -1 - s) for s in got_slots[t].tolist() if s >= 0}
        if result.positions is not None:
            pos = set(result.positions[t][result.positions[t] >= 0].long().tolist())
            if pos != got:
                return f"row {t}: positions and slots disagree", ties
        if len(got) != len(want):
            return f"row {t}: {len(got)} selected, want {len(want)}", ties
        if got != want:
            sc = ref.scores[t, : vis[t]]
            diff = got ^ want
            if any(p < 0 or p >= vis[t] for p in diff):  # a slot outside the visible rows
                return f"row {t}: selection differs at positions {sorted(diff)[:8]}", ties
            kth_pos = min(want, key=lambda p: sc[p].item())
            kth = sc[kth_pos].item()
            tol = tie_band(ref, t, sorted(diff), kth_pos, scale=scale)
            bad = [p for p in diff if abs(sc[p].item() - kth) > tol]
            if bad:
                return f"row {t}: selection differs at positions {sorted(bad)[:8]}", ties
            ties += 1
            continue
        compare.append(t)
    rows = torch.tensor(compare, dtype=torch.long)
    out, lse = result.out.float().cpu()[rows], result.lse.cpu()[rows]
    r_out, r_lse = ref.out.cpu()[rows], ref.lse.cpu()[rows]
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return "NaN in out or lse", ties
    if not torch.equal(torch.isinf(lse), torch.isinf(r_lse)):
        return "lse -inf pattern differs", ties
    fin = torch.isfinite(r_lse)
    if not torch.allclose(lse[fin], r_lse[fin], atol=LSE_ATOL, rtol=LSE_RTOL):
        return f"lse max err {(lse[fin] - r_lse[fin]).abs().max().item():.3g}", ties
    if not torch.allclose(out, r_out, atol=OUT_ATOL, rtol=OUT_RTOL):
        return f"out max err {(out - r_out).abs().max().item():.3g}", ties
    return None, ties


def check_random_step(
    seed: int, device: torch.device | str | None = None, *, topk: int = 128
) -> str | None:
    """One randomized plan-vs-reference comparison (for ``sparse-mla verify``): 1-3 requests
    of 0-400 tokens (some padding requests), uniform or ragged ``n`` in 1-3, padding rows,
    bf16 or fp8 caches, each remap placement, 4 or 16 heads. None when they agree, else
    the reason with the seed."""
    from ..decode.naive import decode_step_reference
    from ..decode.plan import DecodePlan, DecodePlanConfig

    rng = random.Random(seed)
    b = rng.randint(1, 3)
    lens = [rng.choice([0, rng.randint(1, 64), rng.randint(100, 400)]) for _ in range(b)]
    n = [rng.randint(1, 3)] * b if rng.random() < 0.5 else [rng.randint(1, 3) for _ in range(b)]
    pad = rng.randint(0, 2)  # padding rows after uniform (native) or ragged rows
    heads, fp8 = rng.choice([4, 16]), rng.random() < 0.5
    remap = rng.choice(["topk", "attention", "separate"])
    case = random_step(rng, seq_lens=lens, decode_lens=n, num_heads=heads, fp8=fp8,
                       pad_rows=pad, device=device)  # fmt: skip
    cfg = DecodePlanConfig(case.num_tokens, b, case.max_blocks, heads, topk=topk,
                           max_decode_len=3, remap=remap, mla_fp8=fp8)  # fmt: skip
    plan = DecodePlan(cfg, sm_scale=0.135, device=device)
    ref_inputs = clone_inputs(case.inputs)
    got = plan.run(case.inputs, n, num_tokens=case.num_tokens)
    ref = decode_step_reference(**ref_inputs._asdict(), decode_lens=n, topk=topk, sm_scale=0.135)
    if not torch.equal(case.inputs.kv_cache, ref_inputs.kv_cache):
        return f"seed {seed}: MLA cache writes differ"
    if not torch.equal(case.inputs.index_k_cache, ref_inputs.index_k_cache):
        return f"seed {seed}: indexer cache writes differ"
    err, _ = step_error(got, ref, case)
    return None if err is None else f"seed {seed} (lens={lens} n={n} fp8={fp8} {remap}): {err}"


def replay_error(plan: DecodePlan, captured: StepCase, fresh: StepCase, *, topk: int) -> str | None:
    """Copy ``fresh``'s inputs into the buffers a plan's CUDA graph captured
    (``captured.inputs``: new lengths, tables and data, in place), replay the graph and
    compare with the reference on those inputs (:func:`step_error`); a replay that allocates
    fails too. None when all agrees."""
    from dataclasses import replace

    from ..decode.naive import decode_step_reference

    for name, t in fresh.inputs._asdict().items():
        getattr(captured.inputs, name).copy_(t)
    ref_inputs = clone_inputs(captured.inputs)
    got, allocs = cuda_allocations(plan.replay)
    ref = decode_step_reference(**ref_inputs._asdict(), decode_lens=fresh.decode_lens, topk=topk,
                                sm_scale=plan.sm_scale)  # fmt: skip
    err, _ = step_error(got, ref, replace(fresh, inputs=captured.inputs))
    return err or (f"{allocs} allocations during the replay" if allocs else None)


# ---- cases of the custom ops (tests/test_custom_ops.py, benchmarks/gpu_custom_ops.py) --------

OP_CASE_K = 16  # top-k width of the op cases


def _op_case_inputs(case: StepCase) -> tuple:
    """(request rows, sorted request-local positions [B, K], random scores [B, 128])."""
    x = case.inputs
    dev = x.seq_lens.device
    req = torch.arange(x.block_table.shape[0], dtype=torch.int32, device=dev)
    idx = torch.stack([torch.randperm(int(n), device=dev)[:OP_CASE_K].sort().values
                       for n in x.seq_lens])  # fmt: skip
    return req, idx.to(torch.int32), torch.randn(req.shape[0], 128, device=dev)


def custom_op_cases(case: StepCase) -> dict[str, tuple]:
    """Positional arguments (schema order) of each ``torch.ops.sparse_mla`` op over ``case``
    (at least 64 positions per request, ``OP_CASE_K`` columns), for ``torch.library.opcheck``."""
    from .. import library
    from .._custom_op import encode_config
    from ..dcp import global_topk_workspace, local_topk_candidates
    from ..ops.attention import AttentionConfig, attention_workspace
    from ..ops.decode_metadata import ExpandConfig
    from ..ops.topk import TopKConfig, topk_workspace
    from .compressor import compressor_op_args

    x, k, i32, f32 = case.inputs, OP_CASE_K, torch.int32, torch.float32
    dev = x.seq_lens.device
    (b, w), bt, lens, heads = x.block_table.shape, x.block_table, x.seq_lens, x.q.shape[1]
    req, idx, logits = _op_case_inputs(case)
    slots = library.convert_req_index_to_global_index(req, bt, idx)
    ws = global_topk_workspace(b, k=k, dcp_size=2, device=dev)
    cands = torch.stack([
        local_topk_candidates(logits, lens // 2, k=k, dcp_size=2, dcp_rank=r, interleave=1,
                              workspace=ws).clone()
        for r in range(2)
    ])  # fmt: skip
    split = AttentionConfig(num_splits=2, block_n=16)
    attn_ws = attention_workspace(b, heads, k, cache_format="bf16", config=split, device=dev)
    gws = global_topk_workspace(b, k=k, dcp_size=2, device=dev).tensors()

    def out(*shape, dtype=i32):
        return torch.empty(shape, dtype=dtype, device=dev)

    return {
        "expand_decode_tokens": (
            lens, bt, [1, 2], None, 2, 3, None, None, 1, 0, 1, out(3), out(3, w), out(3),
            out(3), None, None,
        ),
        "native_decode_seq_lens": (lens, 2, 2, 1, 1, out(b, 2), None, None),
        "dcp_local_seq_lens": (
            lens, 2, 1, 1, out(b), encode_config(ExpandConfig()), None,
        ),
        "write_indexer_k": (x.k_idx, x.index_k_cache.clone(), x.slot_mapping),
        "write_mla_latent": (x.kv[:, :512], x.kv[:, 512:], x.kv_cache.clone(), x.slot_mapping),
        "index_logits": (
            x.q_idx, x.idx_weights, x.index_k_cache, lens, bt, None, 128, out(b, 128, dtype=f32),
            None,
        ),
        "select_topk": (
            logits, lens, k, out(b, k), bt, req, 64, None, out(b), False,
            topk_workspace(b, device=dev), None, None, encode_config(TopKConfig()), None,
        ),
        "convert_req_index_to_global_index": (
            req, bt, idx, 64, None, None, None, True, out(b, k), out(b), "auto", None,
        ),
        "filter_and_convert_dcp_index": (
            req, bt, idx, 2, 1, 1, 64, None, True, False, out(b, k), out(b), "auto", None,
        ),
        "sparse_mla_decode": (
            x.q, x.kv_cache, slots, 0.135, None, None, None, None, None,
            out(b, heads, 512, dtype=torch.bfloat16), out(b, heads, dtype=f32),
            attn_ws.partial_out, attn_ws.partial_lse, encode_config(split), None,
            None, None, None, None, None,
        ),
        "local_topk_candidates": (logits, lens // 2, k, 2, 1, 1, gws, b, None),
        "merge_topk_candidates": (cands, k, out(b, k), gws, b),
        "rescale_partial": (
            torch.randn(b, heads, 32, device=dev), torch.randn(2, b, heads, device=dev), 1,
            "all_reduce", out(b, heads, 32, dtype=f32), out(b, heads, dtype=f32),
        ),
        "compressor_decode": compressor_op_args(dev),
    }  # fmt: skip


def public_call_cases(case: StepCase) -> list[tuple[str, tuple, dict]]:
    """(public function name, args, kwargs) over ``case``: each public kernel entry called
    as an engine would (outputs allocated by the call, configs, workspaces, host and device
    decode lengths), to compare with its ``sparse_mla.library`` twin (the op path)."""
    from ..ops.attention import AttentionConfig, attention_workspace
    from ..ops.topk import TopKConfig

    x, k = case.inputs, OP_CASE_K
    dev = x.seq_lens.device
    req, idx, logits = _op_case_inputs(case)
    idx[0, -3:] = -1
    heads = x.q.shape[1]
    split = AttentionConfig(num_splits=2, block_n=16)
    ws = attention_workspace(req.shape[0], heads, k, cache_format="bf16", config=split,
                             device=dev)  # fmt: skip
    remap = {"block_table": x.block_table, "req_id": req}
    dl = torch.tensor([2, 1], dtype=torch.int32, device=dev)
    counts = torch.full((req.shape[0],), -7, dtype=torch.int32, device=dev)
    return [
        ("expand_decode_tokens", (x.seq_lens, x.block_table, [2, 1]), {"max_decode_len": 2}),
        ("expand_decode_tokens", (x.seq_lens, x.block_table, dl),
         {"max_decode_len": 2, "num_tokens": 5}),
        ("native_decode_seq_lens", (x.seq_lens,), {"next_n": 3, "dcp_size": 2, "dcp_rank": 1}),
        ("dcp_local_seq_lens", (x.seq_lens,), {"dcp_size": 2, "dcp_rank": 1, "interleave": 2}),
        ("index_logits", (x.q_idx, x.idx_weights, x.index_k_cache, x.seq_lens, x.block_table),
         {"max_len": 100}),
        ("select_topk", (logits, x.seq_lens), {"k": k, "return_valid_counts": True}),
        ("select_topk", (logits, x.seq_lens), {"k": k, **remap, "config": TopKConfig(row_warps=4)}),
        ("convert_req_index_to_global_index", (req, x.block_table, idx),
         {"return_valid_counts": True}),
        ("filter_and_convert_dcp_index", (req, x.block_table, idx),
         {"dcp_size": 2, "dcp_rank": 0, "return_valid_counts": True}),
        ("filter_and_convert_dcp_index", (req, x.block_table, idx),
         {"dcp_size": 2, "dcp_rank": 1, "valid_counts_out": counts}),
        ("sparse_mla_decode", (x.q, x.kv_cache, idx), {"sm_scale": 0.1, **remap}),
        ("sparse_mla_decode", (x.q, x.kv_cache, idx),
         {"sm_scale": 0.1, **remap, "workspace": ws, "config": split}),
        ("local_topk_candidates", (logits, x.seq_lens),
         {"k": k, "dcp_size": 2, "dcp_rank": 1, "interleave": 1}),
    ]  # fmt: skip


def public_function(name: str):
    """The public function of that name (sparse_mla, sparse_mla.dcp or the metadata ops)."""
    import sparse_mla
    from sparse_mla import dcp
    from sparse_mla.ops import decode_metadata

    for home in (sparse_mla, dcp, decode_metadata):
        if hasattr(home, name):
            return getattr(home, name)
    raise KeyError(name)


def compile_cases(case: StepCase) -> dict[str, tuple]:
    """name -> (fn, args): host-side Python over the ops (the metadata builder, uniform and
    ragged; vLLM's and FlashMLA's entries) to run eagerly and under ``torch.compile``; each
    ``fn`` returns a tuple of fresh tensors."""
    from ..compat import flashmla, vllm
    from ..ops.decode_metadata import DecodeMetadataBuilder

    x, k = case.inputs, OP_CASE_K
    dev = x.seq_lens.device
    b, w = x.block_table.shape
    req, idx, _ = _op_case_inputs(case)
    slots = vllm.triton_convert_req_index_to_global_index(req, x.block_table, idx,
                                                          NUM_TOPK_TOKENS=k)  # fmt: skip
    cases = {}
    for kind, lens in (("uniform", [1] * b), ("ragged", [2] + [1] * (b - 1))):
        builder = DecodeMetadataBuilder(2 * b, b, w, 2, device=dev)

        def build(seq_lens, bt, idx, builder=builder, lens=lens):
            m = builder.build(seq_lens, bt, lens)
            rows = idx[m.req_id.long()] if m.flattened else idx
            s = vllm.triton_convert_req_index_to_global_index(m.req_id, m.block_table, rows,
                                                              NUM_TOPK_TOKENS=k)  # fmt: skip
            return m.seq_lens.clone(), m.block_table.clone(), m.req_id.clone(), s

        cases[f"builder_{kind}+vllm_remap"] = (build, (x.seq_lens, x.block_table, idx))

    def vllm_topk(logits, seq_lens, indices):
        vllm.top_k_per_row_decode(logits, 2, seq_lens, indices, 2 * b, *logits.stride())
        return (indices.clone(),)

    logits = torch.randn(2 * b, 128, device=dev)
    lens = x.seq_lens.clamp(max=100)
    cases["vllm.top_k_per_row_decode"] = (
        vllm_topk,
        (logits, lens, torch.empty(2 * b, k, dtype=torch.int32, device=dev)),
    )

    def flash(q, kv_cache, indices):
        meta, _ = flashmla.get_mla_metadata()
        return flashmla.flash_mla_with_kvcache(q, kv_cache, None, None, 512, meta,
                                               softmax_scale=0.1, indices=indices)  # fmt: skip

    cases["flashmla.flash_mla_with_kvcache"] = (flash, (x.q[:, None], x.kv_cache, slots[:, None]))
    return cases


def op_path_matches_public(name: str, args: tuple, kwargs: dict) -> None:
    """``sparse_mla.library.<name>`` (the path ``torch.compile`` takes) gives what the public
    function gives: the same results and the same contents of the ``*out*`` buffers passed
    (poisoned before each run). Raises AssertionError naming what differs."""
    from .. import library
    from .checks import poison

    def run(fn) -> list[torch.Tensor]:
        poison(*buffers.values())
        result = fn(*args, **kwargs)
        result = [result] if isinstance(result, torch.Tensor) else list(result)
        return [t.clone() for t in result + list(buffers.values()) if t is not None]

    buffers = {k: v for k, v in kwargs.items() if "out" in k and isinstance(v, torch.Tensor)}
    want, got = run(public_function(name)), run(getattr(library, name))
    if len(got) != len(want):
        raise AssertionError(f"{name}: {len(got)} results, the public function {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            raise AssertionError(f"{name}: result {i} differs from the public function's")
