"""Benchmark cases for the speculative-decode metadata expansion (section 1 of the spec).

For each (B requests, n tokens per request), uniform data (every n_b = n) and ragged data with
the same token count T (n_b uniform in [1, n], the last trimmed, hence more requests): the
uniform kernel (uniform data only), the ragged kernel fed device decode lengths or row
offsets, and upstream's PyTorch-ops fallback (repeat_interleave with the host-known total,
CUDA-graph capturable). Context lengths L_b are uniform in [n_b, 131072]; the block table has
W = 2048 random page ids per request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..testing import POISON, expansion_inputs, ragged_lens
from ..testing.floor import EXPAND_BYTES_RULE, expand_bytes
from .anchors import Anchors
from .cases import Case, InputSet, OpSpec, Variant, compare_exact, register_op
from .report import Result, Table, fmt_us, ratio_cell, us_of

GRIDS: dict[str, dict[str, Any]] = {
    "full": dict(batches=(1, 8, 64, 256, 512), ns=(2, 3, 4, 8), width=2048, ctx=131072),
    "quick": dict(batches=(1, 64, 512), ns=(2, 4), width=2048, ctx=131072),
    "cpu": dict(batches=(1, 3), ns=(2,), width=64, ctx=4096),
}


def _ops() -> SimpleNamespace:
    """The implementations timed (tests replace this with stand-ins)."""
    import sparse_mla
    from sparse_mla.ops.decode_metadata import naive

    return SimpleNamespace(
        expand=sparse_mla.expand_decode_tokens,
        torch_ops=naive.expand_decode_tokens_torch_ops,
    )


def make_expand_set(lens: Sequence[int], *, width: int, ctx: int, device: torch.device) -> InputSet:
    """The kit's expansion inputs (``expansion_inputs``: L_b in [n_b, ctx], random page ids)."""
    x = expansion_inputs(
        None, list(lens), width=width, seq_lens="at_least_decode_len", ctx=ctx, device=device
    )
    return {
        "seq_lens": x.seq_lens,
        "block_table": x.block_table,
        "decode_lens": torch.tensor(x.decode_lens, dtype=torch.int32, device=device),
        "query_start_loc": x.query_start_loc(),
        "lens_host": x.decode_lens,
        "total": x.total,
        "out": None,  # sized by the first Triton variant bound to this set
    }


def _poison(s: InputSet) -> None:
    for t in s["out"]:
        t.fill_(POISON)


def per_token_outputs(out: Any) -> int:
    """How many per-token int32 outputs (1-D fields) an ``ExpandedDecodeTokens`` has."""
    return sum(1 for x in out if x.dim() == 1)


def _snapshot(ret: Any, s: InputSet) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ret._asdict().items()}


def _triton_variant(fn: Any, name: str, form: str, n: int) -> Variant:
    """``form``: how the decode lengths are given: ``uniform`` (host-known n, an int),
    ``ragged`` (device decode lengths) or ``qsl`` (device row offsets); the ragged forms
    allocate nothing and do not synchronise, also on uniform data."""

    def bind(s: InputSet):
        kw = dict(max_decode_len=n, num_tokens=s["total"], uniform=form == "uniform")
        if form == "qsl":
            kw = dict(kw, uniform=None, query_start_loc=s["query_start_loc"])
        args = (s["seq_lens"], s["block_table"])
        if form != "qsl":
            args += (n if form == "uniform" else s["decode_lens"],)
        if s["out"] is None:
            s["out"] = fn(*args, **kw)
        kw_call = dict(kw, out=s["out"])
        return lambda: fn(*args, **kw_call)

    return Variant(name, bind, "ours")


def _torch_variant(fn: Any) -> Variant:
    def bind(s: InputSet):
        kw = dict(num_tokens=s["total"], total_tokens=s["total"])
        args = (s["seq_lens"], s["block_table"], s["decode_lens"])
        return lambda: fn(*args, **kw)

    return Variant("torch-ops", bind, "baseline", graph_safe=False)


def _bytes_fn(width: int):
    def bytes_moved(sets: Sequence[InputSet], v: Variant) -> int:
        s = sets[0]
        outs = per_token_outputs(s["out"])
        return expand_bytes(len(s["lens_host"]), width, s["total"], per_token_outputs=outs)

    return bytes_moved


def build(grid: str, device: torch.device, anchors: Anchors | None = None) -> list[Case]:
    """The cases of ``grid`` on ``device`` (no anchor times this op: ``anchors`` is unused)."""
    g = GRIDS[grid]
    ops = _ops()
    rng = random.Random(torch.initial_seed())
    w, ctx = g["width"], g["ctx"]

    def case(n: int, b: int, lens: list[int], ragged: bool) -> Case:
        """One expansion case: uniform data runs both kernels, ragged data the ragged one."""
        t, br = sum(lens), len(lens)
        forms = ["ragged", "qsl"] if ragged else ["uniform", "ragged", "qsl"]
        kernels = [_triton_variant(ops.expand, f"triton-{f}", f, n) for f in forms]
        return Case(
            op="expand",
            group=f"expand n={n}",
            plot="expand",
            label=f"B={b} ragged ({br} req)" if ragged else f"B={b} uniform",
            x=t,
            params=dict(
                B=b, n=n, data="ragged" if ragged else "uniform", requests=br, tokens=t, width=w
            ),
            make_set=lambda i: make_expand_set(lens, width=w, ctx=ctx, device=device),
            set_bytes=4 * (br * w + t * w + 2 * br + 4 * t),
            variants=[*kernels, _torch_variant(ops.torch_ops)],
            bytes_moved=_bytes_fn(w),
            poison=_poison,
            snapshot=_snapshot,
            compare=compare_exact,
            reference="torch-ops",
            series_tag=" [ragged data]" if ragged else "",
        )

    cases = []
    for n in g["ns"]:
        for b in g["batches"]:
            cases.append(case(n, b, [n] * b, ragged=False))
            cases.append(case(n, b, ragged_lens(b * n, n, rng), ragged=True))
    return cases


def summaries(results: list[Result]) -> list[Table]:
    """Ragged vs uniform at the same token count, per (B, n)."""
    rs = {
        (r.params.get("B"), r.params.get("n"), r.params.get("data"), r.variant): r
        for r in results
        if r.op == "expand"
    }
    keys = sorted({(b, n) for b, n, _, _ in rs if b is not None}, key=lambda k: (k[1], k[0]))
    rows = []
    for b, n in keys:
        u = rs.get((b, n, "uniform", "triton-uniform"))
        row = [f"{b}", f"{n}", f"{b * n}", fmt_us(us_of(u))]
        for data, v in [("uniform", "triton-ragged"), ("ragged", "triton-ragged")]:
            r = rs.get((b, n, data, v))
            row += [fmt_us(us_of(r)), ratio_cell(r, u)]
        rq = rs.get((b, n, "ragged", "triton-qsl"))
        row += [fmt_us(us_of(rq)), ratio_cell(rq, u)]
        row += [fmt_us(us_of(rs.get((b, n, d, "torch-ops")))) for d in ("uniform", "ragged")]
        rows.append(row)
    if not rows:
        return []
    headers = ["B", "n", "tokens", "uniform us", "ragged kernel, uniform data us", "/uniform"]
    headers += ["ragged kernel, ragged data us", "/uniform"]
    headers += ["ragged kernel, ragged data as offsets us", "/uniform"]
    headers += ["torch-ops uniform us", "torch-ops ragged us"]
    return [
        Table(
            "expansion: ragged kernel vs uniform kernel at the same token count (in graph)",
            headers,
            rows,
            ["ragged data: n_b uniform in [1, n], same total tokens, hence more requests"],
        )
    ]


register_op(
    OpSpec(
        name="expand",
        build=build,
        notes=[
            EXPAND_BYTES_RULE,
            "variants: triton-uniform (uniform=True, host-known n), triton-ragged "
            "(uniform=False, device decode lengths; also on uniform data), triton-qsl (the "
            "ragged kernel given device row offsets, query_start_loc), torch-ops "
            "(upstream's ragged fallback: repeat_interleave with the host-known total). "
            "Ragged data has the same token count as the uniform case, n_b in [1, n].",
        ],
        summaries=summaries,
    )
)
