"""Benchmark cases for the index remap (section 2 of the spec) and its DCP form (section 3):
``ours`` (layout "auto"), the upstream layouts where the caller passes them (``anchors``; the
repository's harness takes them from ``benchmarks/baselines``), and the PyTorch reference;
inputs as in the op's notes below."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..testing.floor import REMAP_BYTES_RULE, count_touched_pages, remap_bytes
from ..testing.inputs import engine_remap_inputs
from .anchors import Anchors
from .cases import Case, InputSet, OpSpec, Variant, compare_exact, poison_keys, register_op
from .report import Result, Table, per_step_table

BLOCK_SIZE = 64

GRIDS: dict[str, dict[str, Any]] = {
    "full": dict(
        ks=(2048, 512, 384),
        # Also with each row's positions ascending, as select_topk emits them.
        ascending_ks=(2048,),
        tokens=(1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384),
        dcp_sizes=(2, 4),
        dcp_k=2048,
        dcp_tokens=(1, 32, 256, 1024, 4096),
        width=2048,
        ctx=131072,
        max_requests=1024,
    ),
}
GRIDS["quick"] = dict(GRIDS["full"], ks=(2048, 384), tokens=(1, 256, 1024), dcp_sizes=(2,))
GRIDS["quick"]["dcp_tokens"] = (1, 256)
# CPU interpreter smoke: tiny, but still a power-of-two K and a non-power-of-two K.
GRIDS["cpu"] = dict(ks=(256, 384), tokens=(1, 3), dcp_sizes=(2,), dcp_k=256, dcp_tokens=(3,))
GRIDS["cpu"].update(width=64, ctx=4096, max_requests=4)


def _ops(anchors: Anchors) -> SimpleNamespace:
    """The implementations timed (tests replace this with stand-ins)."""
    import sparse_mla
    from sparse_mla.ops.remap import naive

    return SimpleNamespace(
        convert=sparse_mla.convert_req_index_to_global_index,
        choose_layout=sparse_mla.choose_remap_layout,
        dcp=sparse_mla.filter_and_convert_dcp_index,
        # The reference takes dcp_size/dcp_rank/interleave/compact itself.
        reference=naive.convert_req_index_to_global_index_reference,
        baselines=dict(anchors.remap_layouts),
    )


def _auto_layout(ops: SimpleNamespace, k: int, t: int, compact: bool, width: int) -> str:
    """What layout='auto' picks for this shape (for the record)."""
    lay = ops.choose_layout(k, count_valid=True, compact=compact, num_rows=t, num_blocks=width)
    return ",".join(f"{f.name}={getattr(lay, f.name)}" for f in dataclasses.fields(lay))


def make_remap_set(
    tokens: int,
    k: int,
    *,
    width: int,
    ctx: int,
    max_requests: int,
    device: torch.device,
    ascending: bool = False,
) -> InputSet:
    """One fresh random input set (the kit's ``engine_remap_inputs``, on torch's default
    generator) with its output buffers. ``ascending`` sorts each row's positions, the order
    ``select_topk`` emits them in."""
    req_id, block_table, idx = engine_remap_inputs(
        None, tokens, k, width=width, ctx=ctx, max_requests=max_requests, ascending=ascending,
        device=device,
    )  # fmt: skip
    return {
        "req_id": req_id,
        "block_table": block_table,
        "token_indices": idx,
        "out": torch.empty(tokens, k, dtype=torch.int32, device=device),
        "counts": torch.empty(tokens, dtype=torch.int32, device=device),
    }


def _set_bytes(tokens: int, k: int, width: int, max_requests: int) -> int:
    return 4 * (2 * tokens * k + 2 * tokens + min(tokens, max_requests) * width)


def _snapshot(sorted_rows: bool):
    """Every variant returns (out, valid counts); compacted DCP rows are compared as sorted
    rows because the atomic layout's prefix order is arbitrary."""

    def snapshot(ret: Any, s: InputSet) -> dict[str, torch.Tensor]:
        out = ret[0].to(torch.int32)
        return {
            "out": out.sort(dim=1).values if sorted_rows else out.clone(),
            "valid counts": ret[1].clone(),
        }

    return snapshot


def _variants(ops: SimpleNamespace, fn: Any, base_kw: dict[str, Any]) -> list[Variant]:
    """``ours`` (layout "auto"), the upstream layouts and the PyTorch reference, all counting."""
    compact = base_kw.get("compact", False)

    def bind_for(layout: str | Callable[..., Any]):
        def bind(s: InputSet):
            args = (s["req_id"], s["block_table"], s["token_indices"])
            lay = layout
            if callable(layout):
                lay = layout(s["token_indices"].shape[1], count_valid=True, compact=compact)
            kw = dict(
                base_kw,
                out=s["out"],
                return_valid_counts=True,
                valid_counts_out=s["counts"],
                layout=lay,
            )
            return lambda: fn(*args, **kw)

        return bind

    def bind_torch(s: InputSet):
        args = (s["req_id"], s["block_table"], s["token_indices"])
        return lambda: ops.reference(*args, **base_kw, return_valid_counts=True)

    return [
        Variant("ours", bind_for("auto"), "ours"),
        *(Variant(name, bind_for(f), "baseline") for name, f in ops.baselines.items()),
        Variant("torch", bind_torch, "baseline", graph_safe=False),
    ]


def _bytes_fn(tokens: int, k: int, width: int, dcp: dict[str, int]):
    touched: list[int] = []  # per case: counted once, shared by its variants

    def bytes_moved(sets: Sequence[InputSet], v: Variant) -> int:
        if not touched:
            pages = [
                count_touched_pages(
                    s["req_id"], s["token_indices"], block_size=BLOCK_SIZE, max_blocks=width, **dcp
                )
                for s in sets
            ]
            touched.append(round(sum(pages) / len(pages)))
        return remap_bytes(tokens, k, touched[0])

    return bytes_moved


def build(grid: str, device: torch.device, anchors: Anchors | None = None) -> list[Case]:
    g = GRIDS[grid]
    ops = _ops(anchors or Anchors())

    def case(k: int, t: int, group: str, plot: str, *, asc=False, dcp_size=1) -> Case:
        # DCP: rank 0's block table pages its local positions, a 1/d share of the context.
        width = -(-g["width"] // dcp_size)
        dcp = dict(dcp_size=dcp_size, dcp_rank=0, interleave=1) if dcp_size > 1 else {}
        kw = dict(block_size=BLOCK_SIZE, compact=True, **dcp) if dcp else {"block_size": BLOCK_SIZE}
        params = dict(K=k, tokens=t)
        params.update(dict(dcp, compact=True) if dcp else {"requests": min(t, g["max_requests"])})
        params.update(
            width=width,
            block_size=BLOCK_SIZE,
            auto_layout=_auto_layout(ops, k, t, bool(dcp), width),
        )
        return Case(
            op="remap",
            group=group,
            plot=plot,
            label=f"T={t}",
            x=t,
            params=params,
            make_set=lambda i: make_remap_set(
                t,
                k,
                width=width,
                ctx=g["ctx"],
                max_requests=g["max_requests"],
                device=device,
                ascending=asc,
            ),
            set_bytes=_set_bytes(t, k, width, g["max_requests"]),
            variants=_variants(ops, ops.dcp if dcp else ops.convert, kw),
            bytes_moved=_bytes_fn(t, k, width, dcp),
            poison=poison_keys("out", "counts"),
            snapshot=_snapshot(sorted_rows=bool(dcp)),
            compare=compare_exact,
            reference="torch",
        )

    cases = []
    orders = [(k, False) for k in g["ks"]] + [(k, True) for k in g.get("ascending_ks", ())]
    for k, asc in orders:
        suffix = " ascending" if asc else ""
        plot = f"remap_K{k}{suffix.replace(' ', '_')}"
        cases += [case(k, t, f"remap K={k}{suffix}", plot, asc=asc) for t in g["tokens"]]
    k = g["dcp_k"]
    for d in g["dcp_sizes"]:
        cases += [
            case(k, t, f"remap DCP={d} K={k}", "remap_dcp", dcp_size=d) for t in g["dcp_tokens"]
        ]
    return cases


def summaries(results: list[Result]) -> list[Table]:
    """Per-decode-step savings at K=2048 (the largest K present in smaller grids)."""
    ks = sorted({r.params.get("K", 0) for r in results if r.group.startswith("remap K=")})
    if not ks:
        return []
    k = 2048 if 2048 in ks else ks[-1]
    present = sorted({r.x for r in results if r.group == f"remap K={k}"})
    tokens = [t for t in (1, 256, 1024) if t in present] or present
    return [
        per_step_table(
            results,
            group=f"remap K={k}",
            ours="ours",
            baselines=("tiled_atomic", "seed"),
            tokens=tokens,
            layers=(61, 78),
            title=f"remap per decode step (K={k}, valid counts on, in-graph times x layers)",
        )
    ]


register_op(
    OpSpec(
        name="remap",
        build=build,
        notes=[
            REMAP_BYTES_RULE,
            "variants: ours = layout 'auto'; tiled_atomic = 128-column tiles each atomically "
            "adding into a zero-filled per-row counter (the zero-fill is inside the timed "
            "call); seed = single tile only for power-of-two K; torch = vectorized PyTorch "
            "reference. All return valid counts; ours overlaps its launch with the previous "
            "kernel's tail (programmatic dependent launch), the baselines, like upstream, do not.",
            "inputs: R = min(T, 1024) requests with context lengths uniform in [1, 131072], "
            "random page ids; the first min(K, L) entries of a row are random positions < L, "
            "the rest -1. DCP: rank 0 of W, interleave 1, compacted; the block table pages "
            "the rank's local positions.",
        ],
        summaries=summaries,
    )
)
