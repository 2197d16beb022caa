"""Benchmark cases for the sparse MLA decode attention (``sparse_mla.sparse_mla_decode``):
``ours`` (global slots), ``ours fused`` (request-local positions through the block table, the
same call) and, where the caller passes them (``anchors``), FlashMLA (fp8 cache) and vLLM's
Triton kernel (bf16 cache). Inputs and checks are in the op's notes below.

The anchor launches are shared with ``benchmarks/gpu_attention.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ..testing import attention_error, poison, random_mla_cache
from ..testing.floor import ATTENTION_BYTES_RULE, attention_bytes, attention_flops, kfmt
from .anchors import Anchors
from .cases import Case, InputSet, OpSpec, Variant, register_op, self_check_of
from .indexer import CachePool
from .report import Result, Table, fmt_ratio, fmt_us, ratio_cell, tflops_of, us_of

SM_SCALE = 0.1352  # V3.2's softmax scale
FUSED, FLASHMLA, VLLM = "ours fused", "FlashMLA", "vLLM Triton"

GRIDS: dict[str, dict[str, Any]] = {
    # invalid_tail: the last entries of each row are -1; check_rows: rows vs the reference.
    "full": dict(
        heads=(16, 128),
        tokens=(1, 8, 128),
        caches=("fp8", "bf16"),
        topk=2048,
        cache_tokens=1 << 20,
        page=64,
        invalid_tail=100,
        check_rows=16,
    ),
}
GRIDS["quick"] = dict(GRIDS["full"], tokens=(1, 128))
GRIDS["cpu"] = dict(GRIDS["full"], heads=(16,), tokens=(2,), topk=128, cache_tokens=2048)
GRIDS["cpu"].update(invalid_tail=16, check_rows=2)


# ---- anchor launches (also used by benchmarks/gpu_attention.py) -------------------------------


def flashmla_launch(fm: Any, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float, sched=None):
    """``(launch, q4)``: ``launch(indices)`` runs FlashMLA's sparse fp8 decode on our inputs and
    returns its raw ``(out [1, T, hk, 512], lse [1, hk, T])``. FlashMLA takes 64 or 128 heads:
    fewer are padded into the zero-filled ``q4``, q copied into it on every call (as engines
    do; the copy is part of the timed call); otherwise ``q4`` is a view of q. ``sched``: a
    ``get_mla_metadata()`` schedule (one per step; made here when None)."""
    t, h, d = q.shape
    hk = 64 if h <= 64 else 128
    q4 = q.unsqueeze(0) if hk == h else q.new_zeros(1, t, hk, d)
    k4 = kv_cache.view(torch.float8_e4m3fn)
    if sched is None:
        sched, _ = fm.get_mla_metadata()

    def launch(indices: torch.Tensor):
        if hk != h:
            q4[0, :, :h].copy_(q)
        return fm.flash_mla_with_kvcache(
            q4, k4, None, None, 512, sched, softmax_scale=sm_scale, is_fp8_kvcache=True,
            indices=indices.view(1, t, indices.shape[1]),
        )  # fmt: skip

    return launch, q4


def flashmla_outputs(out: torch.Tensor, lse: torch.Tensor, heads: int):
    """FlashMLA's raw outputs as ours: out ``[T, h, 512]``, lse ``[T, h]`` (its +inf for a row
    with no valid entry as our -inf)."""
    lse = lse[0, :heads].t()
    return out[0, :, :heads], torch.where(torch.isposinf(lse), float("-inf"), lse)


def vllm_launch(vl: Any, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float):
    """``launch(indices)``: vLLM's Triton kernel on our bf16 cache; returns out ``[T, h, 512]``
    (no lse)."""
    kv3 = kv_cache.view(-1, 1, kv_cache.shape[-1])
    return lambda ix: vl.triton_sparse_mla_attention(q, kv3, ix.view(ix.shape[0], 1, -1), sm_scale)


# ---- cases --------------------------------------------------------------------------------------


def _ops(anchors: Anchors) -> SimpleNamespace:
    """The implementations timed (tests replace this with stand-ins): ours, the reference and
    the anchors the caller passed."""
    import sparse_mla
    from sparse_mla.ops.attention import naive

    notes = list(anchors.notes)
    if anchors.flashmla is None and anchors.vllm is None and not notes:
        notes = ["anchors: none asked for (sparse-mla bench --anchors flashmla,vllm)"]
    return SimpleNamespace(
        decode=sparse_mla.sparse_mla_decode,
        workspace=sparse_mla.attention_workspace,
        reference=naive.sparse_mla_decode_reference,
        flashmla=anchors.flashmla,
        vllm=anchors.vllm,
        notes=notes,
    )


def _filled_mla_cache(pages: int, page: int, dim: int, *, fp8: bool, device: Any) -> torch.Tensor:
    """A latent cache of ``pages`` pages, every row random of magnitude 0.5 (the kit's
    generator). ``dim`` is the pool's key; always 576 here."""
    return random_mla_cache(pages, page, fp8=fp8, g=None, scale=0.5, device=device)


POOL = CachePool(fill=_filled_mla_cache)


def make_attention_set(
    cache: torch.Tensor, *, tokens: int, heads: int, topk: int, invalid_tail: int, workspace: Any
) -> InputSet:
    """Fresh q and indices over the shared cache: each token its own request, whose block table
    row is a random permutation of every page, positions uniform with the last
    ``invalid_tail`` of a row -1, and slots = those positions through the table (so the slots
    are uniform over the cache and both variants read the same rows)."""
    dev, (pages, page) = cache.device, cache.shape[:2]
    q = torch.randn(tokens, heads, 576, device=dev).bfloat16()
    bt = torch.rand(tokens, pages, device=dev).argsort(dim=1).to(torch.int32)
    pos = torch.randint(0, pages * page, (tokens, topk), device=dev, dtype=torch.int32)
    pos[:, topk - invalid_tail :] = -1
    p = pos.long().clamp_min(0)
    slots = torch.where(pos >= 0, bt.long().gather(1, p // page) * page + p % page, -1)
    return {
        "cache": cache, "q": q, "slots": slots.to(torch.int32), "positions": pos,
        "block_table": bt, "req_id": torch.arange(tokens, dtype=torch.int32, device=dev),
        "page": page, "ws": workspace,
        "out": torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=dev),
        "lse": torch.empty(tokens, heads, dtype=torch.float32, device=dev),
    }  # fmt: skip


class _Checker:
    """Snapshot and checks of one case over input set 0: every variant's first ``rows`` rows
    against the fp32 reference (the kit's tolerance), ours fused bit-equal to ours."""

    def __init__(self, reference: Any, rows: int) -> None:
        self.reference, self.rows = reference, rows

    def snapshot(self, ret: Any, s: InputSet) -> dict[str, Any]:
        heads, n = s["q"].shape[1], min(self.rows, s["q"].shape[0])
        if "ref" not in s:  # once per set, shared by every variant's check
            s["ref"] = self.reference(
                s["q"][:n], s["cache"], s["slots"][:n], sm_scale=SM_SCALE, dtype=torch.float32,
                chunk=4, magnitude=True,
            )  # fmt: skip
        ref = s["ref"]
        exact = isinstance(ret, tuple) and ret[0].dim() == 3  # ours (both forms)
        if isinstance(ret, torch.Tensor):  # vLLM: no lse, so only out is checked
            out, lse = ret, ref[1]
        elif exact:
            out, lse = ret
        else:
            out, lse = flashmla_outputs(*ret, heads)
        why = attention_error(out[:n], lse[:n], *ref) or ""
        return {"out": out.clone(), "lse": lse.clone(), "exact": exact, "self": why}

    @staticmethod
    def compare(a: dict[str, Any], ref: dict[str, Any]) -> str:
        if not a["exact"]:
            return ""  # an anchor: held to the reference's tolerance only (self check)
        for key in ("out", "lse"):
            if not torch.equal(a[key], ref[key]):
                return f"mismatch: {key} not bit-equal to the global-slot call"
        return ""


def _ours(ops: SimpleNamespace, fused: bool) -> Variant:
    def bind(s: InputSet):
        kw = dict(sm_scale=SM_SCALE, out=s["out"], lse=s["lse"], workspace=s["ws"])
        if fused:
            kw.update(block_table=s["block_table"], req_id=s["req_id"], block_size=s["page"])
        args = (s["q"], s["cache"], s["positions" if fused else "slots"])
        return lambda: ops.decode(*args, **kw)

    return Variant(FUSED if fused else "ours", bind, "extra" if fused else "ours")


def _anchors(ops: SimpleNamespace, fmt: str, heads: int) -> list[Variant]:
    sched: list[Any] = []  # one FlashMLA schedule per case, made outside the graph

    def bind_flashmla(s: InputSet):
        if not sched:
            sched.append(ops.flashmla.get_mla_metadata()[0])
        launch, _ = flashmla_launch(ops.flashmla, s["q"], s["cache"], SM_SCALE, sched[0])
        return lambda: launch(s["slots"])

    def bind_vllm(s: InputSet):
        launch = vllm_launch(ops.vllm, s["q"], s["cache"], SM_SCALE)
        return lambda: launch(s["slots"])

    out = []
    if ops.flashmla is not None and fmt == "fp8" and heads <= 128:
        out.append(Variant(FLASHMLA, bind_flashmla, "baseline", graph_safe=False))
    if ops.vllm is not None and fmt == "bf16" and heads % 16 == 0:
        out.append(Variant(VLLM, bind_vllm, "baseline", graph_safe=False))
    return out


def build(grid: str, device: torch.device, anchors: Anchors | None = None) -> list[Case]:
    g = GRIDS[grid]
    ops = _ops(anchors or Anchors())
    SPEC.notes[:] = [*NOTES, *ops.notes]
    topk, page, pages = g["topk"], g["page"], g["cache_tokens"] // g["page"]
    cases = []
    for fmt in g["caches"]:
        for h in g["heads"]:
            for t in g["tokens"]:
                shared: dict[str, Any] = {}  # one workspace per case, made on first use

                def make_set(i, fmt=fmt, h=h, t=t, shared=shared):
                    if not shared:
                        shared["ws"] = ops.workspace(t, h, topk, cache_format=fmt, device=device)
                    pool_kw = dict(pages=pages, page=page, dim=576, device=device)
                    cache = POOL.get(fp8=fmt == "fp8", **pool_kw)
                    kw = dict(tokens=t, heads=h, topk=topk, invalid_tail=g["invalid_tail"])
                    return make_attention_set(cache, **kw, workspace=shared["ws"])

                nbytes = attention_bytes(t, topk, fmt)
                chk = _Checker(ops.reference, g["check_rows"])
                set_bytes = nbytes + t * (h * (576 + 512) * 2 + h * 4 + topk * 8 + pages * 4 + 4)
                cases.append(
                    Case(
                        op="attention",
                        group=f"attention {fmt} h_q={h}",
                        plot="attention_decode",
                        label=f"T={t}",
                        x=t,
                        params=dict(cache=fmt, h_q=h, T=t, topk=topk, cache_tokens=pages * page),
                        make_set=make_set,
                        set_bytes=set_bytes,
                        variants=[_ours(ops, False), _ours(ops, True), *_anchors(ops, fmt, h)],
                        bytes_moved=lambda sets, v, nbytes=nbytes: nbytes,
                        poison=lambda s: poison(s["out"], s["lse"]),
                        snapshot=chk.snapshot,
                        compare=chk.compare,
                        reference="ours",
                        self_check=self_check_of,
                        flops=attention_flops(h, t, topk),
                    )
                )
    return cases


def summaries(results: list[Result]) -> list[Table]:
    """Per (cache, h_q, T): ours, the fused form, floor, TFLOPS and the anchor beside it."""
    rs = {
        (r.params["cache"], r.params["h_q"], r.x, r.variant): r
        for r in results
        if r.op == "attention"
    }
    keys = sorted({k[:3] for k in rs}, key=lambda k: (k[0] != "fp8", k[1], k[2]))
    rows = []
    for fmt, h, t in keys:
        ours, fused = rs.get((fmt, h, t, "ours")), rs.get((fmt, h, t, FUSED))
        name = FLASHMLA if fmt == "fp8" else VLLM
        anchor = rs.get((fmt, h, t, name))
        row = [fmt, str(h), str(t), fmt_us(us_of(ours)), fmt_us(us_of(fused))]
        row += [ratio_cell(fused, ours)]
        row += [fmt_us(ours.floor_us), fmt_ratio(ours.over_floor)] if ours else ["n/a"] * 2
        row += [tflops_of(ours), name if anchor else "-", fmt_us(us_of(anchor))]
        rows.append(row + [ratio_cell(anchor, ours) if anchor else "n/a"])
    if not rows:
        return []
    headers = ["cache", "h_q", "T", "ours us", f"{FUSED} us", "fused/ours", "floor us"]
    headers += ["ours/floor", "ours TFLOPS", "anchor", "anchor us", "anchor/ours"]
    topk = next(iter(rs.values())).params["topk"]
    return [
        Table(
            f"attention: ours, the fused remap and the anchors (topk {kfmt(topk)}; in graph, "
            "eager where a graph failed)",
            headers,
            rows,
            [
                "anchor/ours = anchor time / ours (> 1: ours is faster); fused/ours = fused "
                "time / global-slot time; FlashMLA with h_q < 64 runs padded to 64 heads, the "
                "padding copy inside the timed call"
            ],
        )
    ]


NOTES = [
    ATTENTION_BYTES_RULE,
    "variants: ours = sparse_mla_decode on global slots (pre-sized workspace, out and lse "
    "buffers); ours fused = request-local positions + req_id + block_table (page 64), same "
    "call; FlashMLA (fp8 cache; h_q < 64 padded to 64 by copying q into a 64-head buffer each "
    "call, timed with it); vLLM's Triton sparse MLA kernel (bf16 cache). Anchors run when "
    "asked for (--anchors) and they import.",
    "inputs: a 2^20-token cache per format (GPU grids; random latents, written once and "
    "shared), topk 2048, random slots with the last 100 of each row -1; each token its own "
    "request whose block table is a random permutation of the pages; sm_scale 0.1352.",
    "checks: out and lse of the first 16 rows of every variant (vLLM: out only) against the "
    "fp32 reference within the kit's tolerance (attention_error), outputs poisoned first; "
    "ours fused bit-equal to ours.",
]
SPEC = register_op(
    OpSpec(
        name="attention", build=build, notes=list(NOTES), summaries=summaries, cleanup=POOL.clear
    )
)
