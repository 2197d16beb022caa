"""Benchmark cases for the lightning-indexer logits and the whole indexer side of a layer.

1. Logits (``index_logits``), V3.2 shapes, bf16 and fp8 caches: ``native`` (``next_n=n``,
   each request's keys read once for its n rows) against ``flattened`` (rows expanded
   beforehand, ``next_n=1``: the keys read n times) and, on the fp8 cache where the caller
   passes it (``--anchors deepgemm``), DeepGEMM's ``fp8_paged_mqa_logits``. Checked against
   the fp64 reference on the first and last request, the others against native.
2. Per layer (fp8 cache): expand, logits, top-k and remap each alone in a graph, ``chain``
   (the four in one graph) and ``top-k+slots`` (the fused alternative to top-k + remap);
   chain and top-k+slots must give remap's slots and counts bit for bit.

The K caches are filled once per run and shared by the cases of their format: every input
set draws its block table as distinct random pages of it, so rotating sets read different
keys without more memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..ops.indexer.naive import row_visible_lengths
from ..testing import (
    distinct_block_table,
    filled_indexer_cache,
    indexer_queries,
    logits_error,
    logits_tolerance_scale,
)
from ..testing.floor import (
    INDEXER_BYTES_RULE,
    LAYER_BYTES_RULE,
    count_touched_pages,
    expand_bytes,
    indexer_bytes,
    indexer_key_bytes,
    kfmt,
    remap_bytes,
    topk_bytes,
)
from .anchors import Anchors
from .cases import (
    Case,
    InputSet,
    OpSpec,
    Variant,
    compare_exact,
    poison_keys,
    register_op,
    self_check_of,
)
from .expand import per_token_outputs
from .report import (
    Result,
    Table,
    copy_pct,
    fmt_bytes,
    fmt_gbs,
    fmt_ratio,
    fmt_us,
    gbs,
    ratio_cell,
    us_of,
)

LAYERS = 61  # DeepSeek V3.2: one indexer per layer
DEEPGEMM = "DeepGEMM"

GRIDS: dict[str, dict[str, Any]] = {
    "full": dict(
        heads=64,
        dim=128,
        page=64,
        k=2048,
        requests=64,
        ctx=32768,
        dtypes=("bf16", "fp8"),
        ns=(1, 4),
        ref_requests=2,
        layer_batches=(1, 32, 128),
        layer_ctxs=(8192, 32768, 131072),
        layer_ns=(1, 2, 4),
        layer_dtype="fp8",
        layer_budget_ms=100.0,
    ),
}
# The quick grid: the full one with fewer layer cases; the CPU interpreter smoke: tiny heads,
# dims and contexts, both cache formats, both layer paths.
GRIDS["quick"] = dict(GRIDS["full"], layer_batches=(1, 128), layer_ctxs=(32768,), layer_ns=(1, 4))
GRIDS["cpu"] = dict(GRIDS["full"], heads=8, dim=32, k=128, requests=2, ctx=256, layer_batches=(2,))
GRIDS["cpu"].update(layer_ctxs=(256,), layer_ns=(1, 2), layer_budget_ms=None)


def _ops() -> SimpleNamespace:
    """The implementations timed (tests replace this with stand-ins)."""
    import sparse_mla
    from sparse_mla.ops.indexer import naive as indexer_naive

    return SimpleNamespace(
        logits=sparse_mla.index_logits,
        reference=indexer_naive.index_logits_reference,
        expand=sparse_mla.expand_decode_tokens,
        select=sparse_mla.select_topk,
        workspace=sparse_mla.topk_workspace,
        remap=sparse_mla.convert_req_index_to_global_index,
    )


class CachePool:
    """One filled cache per (format, page, dim, device), built on first use at the size the
    whole grid needs and shared by every case; :meth:`clear` frees them after the run.
    ``fill(pages, page, dim, fp8=, device=)`` builds one (default: an indexer K cache)."""

    def __init__(self, fill: Any = filled_indexer_cache) -> None:
        self._caches: dict[tuple[Any, ...], torch.Tensor] = {}
        self._fill = fill
        self.builds = 0

    def get(self, *, fp8: bool, pages: int, page: int, dim: int, device: Any) -> torch.Tensor:
        key = (fp8, page, dim, str(device))
        cache = self._caches.get(key)
        if cache is None or cache.shape[0] < pages:
            self._caches.pop(key, None)
            del cache
            cache = self._fill(pages, page, dim, fp8=fp8, device=device)
            self._caches[key] = cache
            self.builds += 1
        return cache

    def clear(self) -> None:
        self._caches.clear()


POOL = CachePool()


def _expand_kw(n: int) -> dict[str, Any]:
    return dict(max_decode_len=n, uniform=True)


def make_indexer_set(
    ops: SimpleNamespace,
    cache: torch.Tensor,
    *,
    requests: int,
    n: int,
    ctx: int,
    heads: int,
    dim: int,
    page: int,
    fp8: bool,
    device: torch.device,
    k: int | None = None,
) -> InputSet:
    """Fresh queries and weights, a block table of distinct random pages of ``cache``, the
    logits buffer and (n > 1) the expanded rows. With ``k``: also every intermediate of the
    layer chain, filled by running it once (so each stage timed alone reads what its
    producer wrote)."""
    width = -(-ctx // page)
    rows = requests * n
    bt = distinct_block_table(cache.shape[0], requests, width, device=device)
    seq_lens = torch.full((requests,), ctx, dtype=torch.int32, device=device)
    q, w = indexer_queries(rows, heads, dim, fp8=fp8, device=device)
    s: InputSet = {
        "cache": cache,
        "block_table": bt,
        "seq_lens": seq_lens,
        "q": q,
        "weights": w,
        "n": n,
        "logits": torch.empty(rows, width * page, dtype=torch.float32, device=device),
        "exp": ops.expand(seq_lens, bt, n, **_expand_kw(n)) if n > 1 else None,
    }
    if k is None:
        return s
    s["ws"] = ops.workspace(rows, device)
    s["pos"] = torch.empty(rows, k, dtype=torch.int32, device=device)
    for name in SLOT_STAGES:
        s[f"{name}_out"] = torch.empty(rows, k, dtype=torch.int32, device=device)
        s[f"{name}_counts"] = torch.empty(rows, dtype=torch.int32, device=device)
    if n > 1:
        s["row_lens"], s["req_id"] = s["exp"].seq_lens, s["exp"].req_id
    else:
        s["row_lens"] = seq_lens
        s["req_id"] = torch.arange(requests, dtype=torch.int32, device=device)
    _layer_calls(ops, s, k, page)["chain"]()
    return s


def _case_set(ops, g: dict[str, Any], pages: dict[bool, int], device, *, fp8: bool, **kw):
    """``make_set`` of a case: its input set over the shared cache of its format."""
    cache_kw = dict(page=g["page"], dim=g["dim"], device=device)
    kw = dict(heads=g["heads"], dim=g["dim"], page=g["page"], fp8=fp8, device=device, **kw)
    return lambda i: make_indexer_set(ops, POOL.get(fp8=fp8, pages=pages[fp8], **cache_kw), **kw)


# --------------------------------------------------------------------------------------------
# 1. Logits: native vs flattened
# --------------------------------------------------------------------------------------------


class _LogitsChecker:
    """Snapshot and checks of one logits case, over input set 0."""

    def __init__(self, reference: Any, ref_requests: int, *, fp8: bool, device: Any, **shape):
        self.reference = reference
        self.ref_requests = ref_requests
        self.kw = dict(heads=shape["heads"], dim=shape["dim"], fp8=fp8, device=device)
        self.tol = logits_tolerance_scale(shape["heads"], shape["dim"], fp8=fp8, device=device)

    def vs_reference(self, out: torch.Tensor, s: InputSet) -> str:
        """Rows of the first/last request against the fp64 reference over their own pages."""
        n, bt = s["n"], s["block_table"]
        b_count, width = bt.shape
        reqs = list(dict.fromkeys([0, b_count - 1]))[: self.ref_requests]
        sub_bt = torch.arange(width, dtype=torch.int32, device=bt.device)[None, :]
        for b in reqs:
            rows = slice(b * n, (b + 1) * n)
            sub = s["cache"][bt[b].long()]
            args = (s["q"][rows], s["weights"][rows], sub, s["seq_lens"][b : b + 1], sub_bt)
            kw = dict(next_n=n, max_len=out.shape[1])
            ref = self.reference(*args, **kw)
            mag = self.reference(*args, **kw, magnitude=True)
            why = logits_error(out[rows], ref, mag, **self.kw)
            if why:
                return f"request {b}: {why} (vs fp64)"
        return ""

    def snapshot(self, ret: Any, s: InputSet) -> dict[str, Any]:
        out = ret.clone()
        return {"logits": out, "self": self.vs_reference(out, s)}

    def compare(self, a: dict[str, Any], ref: dict[str, Any]) -> str:
        x, y = a["logits"], ref["logits"]
        if x.shape != y.shape:
            return f"mismatch: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if not torch.equal(torch.isneginf(x), torch.isneginf(y)):
            return "mismatch in the -inf pattern"
        fin = torch.isfinite(y)
        rowmax = torch.where(fin, y.abs(), 0).amax(dim=1, keepdim=True)
        # Loose (the fp64 check is the precise one): |err| <= tol x magnitude, and the
        # magnitude sum_h |w| |q.k| is at most a few tens of row maxima at these shapes.
        bound = 64 * self.tol * rowmax + 1e-30
        bad = fin & ~(torch.isfinite(x) & ((x - y).abs() <= bound))
        if bool(bad.any()):
            return f"mismatch in logits ({int(bad.sum())} of {y.numel()} beyond the bound)"
        return ""


def _logits_variants(ops: SimpleNamespace, n: int) -> list[Variant]:
    def native(s: InputSet):
        args = (s["q"], s["weights"], s["cache"], s["seq_lens"], s["block_table"])
        return lambda: ops.logits(*args, next_n=n, out=s["logits"])

    def flattened(s: InputSet):
        f = s["exp"]
        args = (s["q"], s["weights"], s["cache"], f.seq_lens, f.block_table)
        return lambda: ops.logits(*args, next_n=1, out=s["logits"])

    variants = [Variant("native", native, "ours")]
    if n > 1:
        variants.append(Variant("flattened", flattened, "baseline"))
    return variants


def _deepgemm_variants(dg: Any, chk: _LogitsChecker, n: int, page: int) -> list[Variant]:
    """DeepGEMM's paged logits (fp8 cache; none without the module), its calling convention:
    q ``[B, n, H, D]``, the cache as ``[pages, page, 1, D + 4]`` bytes (our layout), 2-D
    context lengths (each row's visible length) and its schedule, made once per input set
    outside the timed call as engines make it once per step. It allocates its logits (rows
    padded) per call and leaves garbage past each row's length (``clean_logits=False``, the
    engines' setting): the snapshot masks that to -inf, as ours writes it, before the checks.
    Its sm_90 kernel takes next_n 1 or 2 only (it asserts otherwise), so larger n have none."""
    if dg is None or n > 2:
        return []

    def bind(s: InputSet):
        q, bt, max_len = s["q"], s["block_table"], s["logits"].shape[1]
        b = bt.shape[0]
        q4 = q.view(b, n, *q.shape[1:])
        kv = s["cache"].view(s["cache"].shape[0], page, 1, -1)
        ctx = row_visible_lengths(s["seq_lens"], n, bt.shape[1] * page).int().view(b, n)
        s["deepgemm_lens"] = ctx  # for the snapshot
        sched = dg.get_paged_mqa_logits_metadata(ctx, page, dg.get_num_sms())
        w = s["weights"]
        return lambda: dg.fp8_paged_mqa_logits(q4, kv, w, ctx, bt, sched, max_len, False)

    def snapshot(ret: Any, s: InputSet) -> dict[str, Any]:
        cols = torch.arange(ret.shape[1], device=ret.device)
        visible = cols[None, :] < s["deepgemm_lens"].reshape(-1, 1).long()
        return chk.snapshot(torch.where(visible, ret, float("-inf")), s)

    return [Variant(DEEPGEMM, bind, "baseline", graph_safe=False, snapshot=snapshot)]


def _logits_cases(
    g: dict[str, Any],
    ops: SimpleNamespace,
    device: torch.device,
    pages: dict[bool, int],
    deepgemm: Any = None,
) -> list[Case]:
    heads, dim, page = g["heads"], g["dim"], g["page"]
    shape = dict(heads=heads, dim=dim, page=page)
    b, ctx = g["requests"], g["ctx"]
    width = -(-ctx // page)
    cases = []
    for dtype in g["dtypes"]:
        fp8 = dtype == "fp8"
        for n in g["ns"]:
            rows = b * n
            chk = _LogitsChecker(ops.reference, g["ref_requests"], fp8=fp8, device=device, **shape)
            nbytes = indexer_bytes(
                b, n, ctx, heads, dim, fp8=fp8, block_size=page, max_len=width * page
            )
            set_bytes = b * ctx * indexer_key_bytes(dim, fp8=fp8) + rows * width * page * 4
            set_bytes += rows * heads * (dim + 4) + (rows + b) * width * 4 * (2 if n > 1 else 0)
            cases.append(
                Case(
                    op="indexer",
                    group=f"indexer {dtype} B={b} ctx={kfmt(ctx)}",
                    plot="indexer",
                    label=f"n={n}",
                    x=rows,
                    params=dict(kind="logits", dtype=dtype, B=b, ctx=ctx, n=n, rows=rows, **shape),
                    make_set=_case_set(ops, g, pages, device, fp8=fp8, requests=b, n=n, ctx=ctx),
                    set_bytes=set_bytes,
                    variants=_logits_variants(ops, n)
                    + (_deepgemm_variants(deepgemm, chk, n, page) if fp8 else []),
                    bytes_moved=lambda sets, v, nbytes=nbytes: nbytes,
                    poison=poison_keys("logits"),
                    snapshot=chk.snapshot,
                    compare=chk.compare,
                    reference="native",
                    self_check=self_check_of,
                )
            )
    return cases


# --------------------------------------------------------------------------------------------
# 2. The indexer side of one layer
# --------------------------------------------------------------------------------------------


def _layer_calls(ops: SimpleNamespace, s: InputSet, k: int, page: int) -> dict[str, Any]:
    """Zero-argument launches of every stage over set ``s`` (and the chain of them)."""
    n = s["n"]
    ex_args = (s["seq_lens"], s["block_table"], n)
    ex_kw = dict(_expand_kw(n), out=s["exp"])
    lg_args = (s["q"], s["weights"], s["cache"], s["seq_lens"], s["block_table"])
    lg_kw = dict(next_n=n, out=s["logits"])
    tk_args = (s["logits"], s["row_lens"])
    tk_kw = dict(k=k, out=s["pos"], workspace=s["ws"])
    rm_args = (s["req_id"], s["block_table"], s["pos"])

    def slots_kw(name: str) -> dict[str, Any]:  # slots and valid counts into s[name_*]
        out, counts = s[f"{name}_out"], s[f"{name}_counts"]
        return dict(block_size=page, out=out, return_valid_counts=True, valid_counts_out=counts)

    rm_own, rm_chain = slots_kw("remap"), slots_kw("chain")
    fu_kw = dict(slots_kw("fused"), k=k, workspace=s["ws"], block_table=s["block_table"])
    fu_kw["req_id"] = s["req_id"]

    def chain() -> Any:
        if n > 1:
            ops.expand(*ex_args, **ex_kw)
        ops.logits(*lg_args, **lg_kw)
        ops.select(*tk_args, **tk_kw)
        return ops.remap(*rm_args, **rm_chain)

    calls = {
        "chain": chain,
        "logits": lambda: ops.logits(*lg_args, **lg_kw),
        "top-k": lambda: ops.select(*tk_args, **tk_kw),
        "remap": lambda: ops.remap(*rm_args, **rm_own),
        "top-k+slots": lambda: ops.select(*tk_args, **fu_kw),
    }
    if n > 1:
        calls["expand"] = lambda: ops.expand(*ex_args, **ex_kw)
    return calls


LAYER_STAGES = ("expand", "logits", "top-k", "remap")
SLOT_STAGES = ("remap", "fused", "chain")  # the stages that write slots and valid counts
SLOT_OUTPUTS = tuple(f"{n}_{x}" for n in SLOT_STAGES for x in ("out", "counts"))


def _layer_variants(ops: SimpleNamespace, n: int, k: int, page: int) -> list[Variant]:
    # expand last: the stages present at every n keep their plot colours across panels
    names = ["chain", "logits", "top-k", "remap", "top-k+slots"] + (["expand"] if n > 1 else [])

    def bind_for(name: str):
        return lambda s: _layer_calls(ops, s, k, page)[name]

    return [Variant(v, bind_for(v), "ours" if v == "chain" else "extra") for v in names]


def _layer_snapshot(ret: Any, s: InputSet | None = None) -> dict[str, Any]:
    """Slots and counts of the stages that return them (chain, remap, top-k+slots), else {}."""
    if isinstance(ret, tuple) and len(ret) == 2 and ret[0].dim() == 2:
        return {"slots": ret[0].clone(), "valid counts": ret[1].clone()}
    return {}


def _layer_self_check(snap: dict[str, Any]) -> str:
    if "slots" not in snap:
        return ""
    if bool((snap["slots"] < -1).any()):
        return "unwritten (poisoned) slots"
    if not torch.equal(snap["valid counts"], (snap["slots"] >= 0).sum(dim=1, dtype=torch.int32)):
        return "valid counts differ from the slots written"
    return ""


def _layer_bytes_fn(b: int, n: int, ctx: int, g: dict[str, Any], fp8: bool):
    heads, dim, page, k = g["heads"], g["dim"], g["page"], g["k"]
    width = -(-ctx // page)
    rows = b * n
    memo: dict[str, int] = {}

    def bytes_moved(sets: Sequence[InputSet], v: Variant) -> int:
        if not memo:
            s = sets[0]
            touched = count_touched_pages(s["req_id"], s["pos"], block_size=page, max_blocks=width)
            per_tok = per_token_outputs(s["exp"]) if n > 1 else 0
            memo["expand"] = expand_bytes(b, width, rows, per_token_outputs=per_tok) if n > 1 else 0
            memo["logits"] = indexer_bytes(
                b, n, ctx, heads, dim, fp8=fp8, block_size=page, max_len=width * page
            )
            memo["top-k"] = topk_bytes(rows, width * page, k)
            memo["remap"] = remap_bytes(rows, k, touched)
            memo["top-k+slots"] = topk_bytes(rows, width * page, k, fused_pages=touched)
            memo["chain"] = sum(memo[v] for v in LAYER_STAGES)
        return memo[v.name]

    return bytes_moved


def _layer_cases(
    g: dict[str, Any], ops: SimpleNamespace, device: torch.device, pages: dict[bool, int]
) -> list[Case]:
    heads, dim, page, k = g["heads"], g["dim"], g["page"], g["k"]
    shape = dict(heads=heads, dim=dim, page=page)
    fp8 = g["layer_dtype"] == "fp8"
    params = dict(kind="layer", dtype=g["layer_dtype"])
    ws_row = ops.workspace(1, torch.device("cpu")).numel() * 4
    cases = []
    for ctx in g["layer_ctxs"]:
        width = -(-ctx // page)
        for n in g["layer_ns"]:
            for b in g["layer_batches"]:
                rows = b * n
                size = dict(requests=b, n=n, ctx=ctx)
                set_bytes = b * ctx * indexer_key_bytes(dim, fp8=fp8) + rows * width * page * 4
                set_bytes += rows * heads * (dim + 4) + 4 * rows * (7 * k + 8)
                set_bytes += 4 * (b + (rows if n > 1 else 0)) * width + ws_row * rows
                cases.append(
                    Case(
                        op="indexer",
                        group=f"indexer layer ctx={kfmt(ctx)} n={n}",
                        plot=f"indexer_layer_ctx{kfmt(ctx)}",
                        label=f"B={b}",
                        x=rows,
                        params=dict(params, B=b, ctx=ctx, n=n, rows=rows, k=k, **shape),
                        make_set=_case_set(ops, g, pages, device, fp8=fp8, k=k, **size),
                        set_bytes=set_bytes,
                        variants=_layer_variants(ops, n, k, page),
                        bytes_moved=_layer_bytes_fn(b, n, ctx, g, fp8),
                        poison=poison_keys(*SLOT_OUTPUTS),
                        snapshot=_layer_snapshot,
                        compare=compare_exact,
                        reference="remap",
                        self_check=_layer_self_check,
                        budget_ms=g["layer_budget_ms"],
                    )
                )
    return cases


def pages_needed(g: dict[str, Any]) -> dict[bool, int]:
    """Pages of the shared cache per format (fp8?) that the grid's largest case draws."""
    page = g["page"]
    need: dict[bool, int] = {}
    for dtype in g["dtypes"]:
        fp8 = dtype == "fp8"
        need[fp8] = max(need.get(fp8, 0), g["requests"] * -(-g["ctx"] // page))
    if g["layer_batches"] and g["layer_ctxs"] and g["layer_ns"]:
        fp8 = g["layer_dtype"] == "fp8"
        big = max(g["layer_batches"]) * -(-max(g["layer_ctxs"]) // page)
        need[fp8] = max(need.get(fp8, 0), big)
    return need


def _anchor_notes(anchors: Anchors) -> list[str]:
    notes = [n for n in anchors.notes if "deep_gemm" in n or "flashinfer" in n.lower()]
    if anchors.deepgemm is None and not notes:
        notes = ["DeepGEMM: not asked for (sparse-mla bench --anchors deepgemm)"]
    if anchors.flashinfer is not None:
        notes.append(
            "FlashInfer's paged MQA logits (fp8_paged_mqa_logits) run on SM100/SM103/SM107 "
            "only (CuTe DSL kernels): not timed here"
        )
    return notes


def build(grid: str, device: torch.device, anchors: Anchors | None = None) -> list[Case]:
    """The cases of ``grid`` on ``device``; DeepGEMM's logits beside ours (fp8 cache) where
    ``anchors`` has it."""
    g = GRIDS[grid]
    ops = _ops()
    anchors = anchors or Anchors()
    SPEC.notes[:] = [*NOTES, *_anchor_notes(anchors)]
    pages = pages_needed(g)
    logits = _logits_cases(g, ops, device, pages, anchors.deepgemm)
    return logits + _layer_cases(g, ops, device, pages)


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def logits_summary(results: Sequence[Result]) -> list[Table]:
    rs = [r for r in results if r.op == "indexer" and r.params.get("kind") == "logits"]
    if not rs:
        return []
    native = {(r.params["dtype"], r.params["n"]): r for r in rs if r.variant == "native"}
    rows = []
    for r in rs:
        t, p = r.best_us, r.params
        speedup = ratio_cell(r, native.get((p["dtype"], p["n"]))) if r.variant != "native" else ""
        row = [p["dtype"], str(p["B"]), kfmt(p["ctx"]), str(p["n"]), r.variant, fmt_us(t)]
        row += [fmt_bytes(r.bytes_moved), fmt_us(r.floor_us)]
        row += [fmt_gbs(gbs(r.bytes_moved, t)) if t else "n/a", copy_pct(r)]
        rows.append(row + [fmt_ratio(r.over_floor), "" if speedup == "n/a" else speedup])
    headers = ["cache", "B", "ctx", "n", "variant", "us", "bytes", "floor us", "GB/s"]
    headers += ["% copy", "/floor", "native speedup"]
    return [
        Table(
            "indexer logits: achieved bandwidth, % of copy bandwidth (in graph)",
            headers,
            rows,
            [
                "bytes: the problem's fewest bytes (keys read once per request), the same for "
                "native and flattened; % copy = achieved GB/s / copy GB/s of this run",
                "native speedup = this variant's time / native's at the same n",
                "goal (issue 35): native fp8 n=1 at >= 90% of copy bandwidth",
            ],
        )
    ]


def layer_summary(results: Sequence[Result]) -> list[Table]:
    rs = [r for r in results if r.op == "indexer" and r.params.get("kind") == "layer"]
    if not rs:
        return []
    by = {(r.params["B"], r.params["ctx"], r.params["n"], r.variant): r for r in rs}
    keys = sorted({(r.params["ctx"], r.params["B"], r.params["n"]) for r in rs})
    rows = []
    for ctx, b, n in keys:
        stage = {v: us_of(by.get((b, ctx, n, v))) for v in (*LAYER_STAGES, "chain", "top-k+slots")}
        parts = [stage[v] for v in LAYER_STAGES if n > 1 or v != "expand"]
        total = sum(parts) if all(p is not None for p in parts) else None
        fused_parts = [stage["expand"] if n > 1 else 0.0, stage["logits"], stage["top-k+slots"]]
        fused = sum(fused_parts) if all(p is not None for p in fused_parts) else None
        chain = by.get((b, ctx, n, "chain"))
        row = [str(b), kfmt(ctx), str(n), str(b * n), fmt_us(stage["expand"]) if n > 1 else "-"]
        row += [fmt_us(stage[v]) for v in ("logits", "top-k", "remap")]
        row += [fmt_us(total), fmt_us(stage["chain"])]
        row += [fmt_us(chain.floor_us), fmt_ratio(chain.over_floor)] if chain else ["n/a"] * 2
        row += [fmt_us(stage["top-k+slots"]), fmt_us(fused)]
        rows.append(row + [f"{total * LAYERS / 1e3:.2f}" if total is not None else "n/a"])
    dtype = rs[0].params.get("dtype", "")
    headers = ["B", "ctx", "n", "rows", "expand us", "logits us", "top-k us", "remap us"]
    headers += ["sum us", "chain us", "chain floor us", "chain/floor", "top-k+slots us"]
    headers += ["fused sum us", f"sum x{LAYERS} ms"]
    return [
        Table(
            f"indexer side per layer ({dtype} cache, k={rs[0].params.get('k')}; "
            "each stage in its own graph, summed; chain = all stages in one graph)",
            headers,
            rows,
            [
                "stages: expand (n > 1) + native logits (next_n = n) + top-k over B*n rows + "
                "remap to slots with valid counts; fused sum = expand + logits + top-k+slots "
                "(the fused epilogue replaces top-k + remap)",
                "engines build the expansion once per decode step (metadata), not per layer; "
                f"sum x{LAYERS} counts it per layer (an upper bound)",
            ],
        )
    ]


def summaries(results: list[Result]) -> list[Table]:
    return logits_summary(results) + layer_summary(results)


NOTES = [
    INDEXER_BYTES_RULE,
    LAYER_BYTES_RULE,
    "logits variants: native (next_n = n, keys read once per request), flattened "
    "(rows pre-expanded with expand_decode_tokens, next_n = 1); DeepGEMM (--anchors deepgemm, "
    "fp8 cache): fp8_paged_mqa_logits with its schedule (get_paged_mqa_logits_metadata, made "
    "once per input set outside the timed call), clean_logits=False, 2-D context lengths; it "
    "allocates its (row-padded) logits in each call. V3.2 shapes: q [rows, 64, 128] (bf16 / "
    "e4m3), fp32 weights [rows, 64], page 64; every request at full context.",
    "layer variants: chain (expand + logits + top-k + remap in one graph), each stage "
    "alone, top-k+slots (the fused epilogue). fp8 cache, k = 2048 (GPU grids).",
    "K caches: filled once per run with random keys (write_indexer_k) and shared; each "
    "input set uses distinct random pages of it.",
    "checks: logits of the first and last request vs the fp64 reference (error <= tol x "
    "magnitude, exact -inf pattern), flattened and DeepGEMM vs native (DeepGEMM's columns past "
    "each row's length, unwritten by contract, set to -inf first); chain and top-k+slots "
    "slots and counts == remap's bit for bit.",
]
SPEC = register_op(
    OpSpec(name="indexer", build=build, notes=list(NOTES), summaries=summaries, cleanup=POOL.clear)
)
