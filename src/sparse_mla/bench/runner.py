"""``sparse-mla bench``: run the registered cases, print their tables, and write the run's record
(``OUT/results.json``) and the tables (``OUT/table.txt``)."""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from .. import _runtime
from ..testing import POISON
from ..testing.floor import FLOOR_RULE, floor_us
from ..testing.timing import (
    Backend,
    Timing,
    measure_copy_bandwidth,
    measure_eager,
    measure_graph,
    measure_launch_floor,
    plan_sizes,
    probe_us,
    rotation_sets,
    select_backend,
)
from .anchors import ANCHOR_MODULES, Anchors, import_anchors
from .cases import OPS, Case, OpSpec
from .record import Run, write_runs_json
from .report import Result, finalize, fmt_bytes, fmt_us, group_tables, render_text

#: op name -> module that registers it. Adding an op = one module + one line here.
OP_MODULES: dict[str, str] = {
    "remap": "sparse_mla.bench.remap",
    "expand": "sparse_mla.bench.expand",
    "topk": "sparse_mla.bench.topk",
    "indexer": "sparse_mla.bench.indexer",
    "attention": "sparse_mla.bench.attention",
}
DEFAULT_OPS = ("remap", "expand")

NO_CUDA_MESSAGE = (
    "sparse-mla bench: no CUDA device (kernels would run in Triton's CPU interpreter, where "
    "times mean nothing). Run it on a GPU, or pass --allow-cpu for a tiny smoke run that "
    "exercises the whole pipeline."
)


@dataclass
class RunConfig:
    graph_calls: int = 128  # calls captured per graph (and per eager repetition)
    reps: int = 30  # timed repetitions (median reported)
    warmup: int = 3  # graph replays before timing
    budget_ms: float = 200.0  # per variant and mode: slow variants get fewer calls/reps
    mem_cap_bytes: int = 2 << 30  # input sets held at once


def load_op(name: str) -> OpSpec:
    if name not in OP_MODULES:
        raise KeyError(name)
    importlib.import_module(OP_MODULES[name])
    return OPS[name]


def resolve_ops(text: str) -> list[str]:
    """``--ops`` value -> op names in order, duplicates dropped; ``all`` = every op."""
    ops = [o.strip() for o in text.split(",") if o.strip()]
    if "all" in ops:
        return list(OP_MODULES)
    return list(dict.fromkeys(ops))


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:160] if msg else ''}"


def run_case(
    case: Case, backend: Backend, cfg: RunConfig, launch_us: float, bw: float
) -> tuple[list[Result], list[str]]:
    """Time every variant of one case; returns its results and any errors (as text)."""
    n_sets = rotation_sets(
        case.set_bytes, backend.l2_bytes, max_sets=cfg.graph_calls, mem_cap_bytes=cfg.mem_cap_bytes
    )
    sets = [case.make_set(i) for i in range(n_sets)]
    backend.synchronize()
    errors: list[str] = []
    snaps: dict[str, Any] = {}
    budget = min(cfg.budget_ms, case.budget_ms) if case.budget_ms else cfg.budget_ms
    timed: list[tuple[Any, Any, Any, str]] = []  # (variant, graph Timing, eager Timing, note)
    for v in case.variants:
        note, where = "", f"{case.group} {case.label} {v.name}"
        try:
            calls = [v.bind(s) for s in sets]
            case.poison(sets[0])
            snapshot = v.snapshot or case.snapshot
            snaps[v.name] = snapshot(calls[0](), sets[0])  # also compiles
            for c in calls[1 : min(4, cfg.graph_calls)]:
                c()
            backend.synchronize()
            est = probe_us(calls, backend, n=min(4, cfg.graph_calls)) if backend.probe else 0.0
            n_calls, reps = plan_sizes(
                est, max_calls=cfg.graph_calls, max_reps=cfg.reps, budget_ms=budget
            )
        except Exception as e:  # a broken variant must not stop the run
            errors.append(f"{where}: {_short(e)}")
            timed.append((v, None, None, f"error: {_short(e)}"))
            traceback.print_exc(limit=3)
            continue
        g = ev = None
        kw = dict(reps=reps, backend=backend)
        try:
            g = measure_graph(calls, graph_calls=n_calls, warmup=cfg.warmup, **kw)
        except Exception as e:  # e.g. a baseline that synchronises cannot be captured
            note = f"graph capture failed: {_short(e)}"
            if v.graph_safe:
                errors.append(f"{where}: {note}")
            try:
                backend.synchronize()
            except Exception as e2:
                errors.append(f"{where}: device error {_short(e2)}")
        try:
            ev = measure_eager(calls, n_calls=n_calls, warmup=min(cfg.warmup, 1), **kw)
        except Exception as e:
            errors.append(f"{where} eager: {_short(e)}")
            note = (note + "; " if note else "") + f"eager failed: {_short(e)}"
        del calls
        timed.append((v, g, ev, note))

    ref = case.reference if case.reference in snaps else next(iter(snaps), None)
    ws = n_sets * case.set_bytes
    results = []
    for v, g, ev, note in timed:
        if v.name not in snaps:
            check = "error"
        elif v.name == ref:
            check = "reference"
        elif case.compare is None:
            check = "skipped"
        else:
            check = case.compare(snaps[v.name], snaps[ref]) or "ok"
        if case.self_check is not None and v.name in snaps:
            own = case.self_check(snaps[v.name])
            if own:
                check = own if own.startswith("mismatch") else f"mismatch: {own}"
        if check.startswith("mismatch"):
            errors.append(f"{case.group} {case.label} {v.name}: {check} vs {ref}")
        nbytes = case.bytes_moved(sets, v)
        results.append(
            Result(
                op=case.op,
                group=case.group,
                plot=case.plot,
                case=case.label,
                variant=v.name,
                role=v.role,
                series=v.name + case.series_tag,
                x=case.x,
                params=dict(case.params),
                bytes_moved=nbytes,
                floor_us=floor_us(launch_us, nbytes, bw, case.flops),
                launch_us=launch_us,
                copy_gbs=bw / 1e9,
                n_sets=n_sets,
                working_set_bytes=ws,
                l2_bytes=backend.l2_bytes,
                **_timing_fields("graph", g),
                **_timing_fields("eager", ev),
                check=check,
                note=note,
                flops=case.flops,
            )
        )
    del sets, snaps
    backend.release()
    return results, errors


def _timing_fields(mode: str, t: Timing | None) -> dict[str, Any]:
    """``Result``'s median, min, calls and reps of one timing mode (None: not measured)."""
    return {
        f"{mode}_us": t.median_us if t else None,
        f"{mode}_min_us": t.min_us if t else None,
        f"{mode}_calls": t.calls if t else 0,
        f"{mode}_reps": t.reps if t else 0,
    }


def _progress(i: int, n: int, case: Case, rs: list[Result]) -> str:
    cells = [f"{r.variant} {fmt_us(r.graph_us)}/{fmt_us(r.eager_us)}" for r in rs]
    bad = [r.variant for r in rs if r.check.startswith("mismatch") or r.check == "error"]
    flag = f"  !! {', '.join(bad)}" if bad else ""
    return f"[{i}/{n}] {case.group} {case.label}: " + " | ".join(cells) + flag


def _measure_floors(backend: Backend, cfg: RunConfig) -> dict[str, float]:
    """The floor's terms, measured in this run (the names are the JSON's ``meta`` keys)."""
    kw = dict(graph_calls=cfg.graph_calls, reps=max(cfg.reps, 3), warmup=cfg.warmup)
    launch_g, launch_e = measure_launch_floor(backend, **kw)
    # With programmatic dependent launch (where supported; mode 1, so each launch can start
    # while the one before runs) a launch overlaps its predecessor: printed for reference,
    # the floor keeps the plain launch.
    launch_pdl, _ = measure_launch_floor(backend, **kw, pdl=1)
    cuda = backend.name == "cuda"
    copy_bytes = (1 << 30) if cuda else (4 << 20)
    bw = measure_copy_bandwidth(backend, copy_bytes, reps=10 if cuda else 3)
    return {
        "launch_graph_us": launch_g.median_us,
        "launch_eager_us": launch_e.median_us,
        "launch_graph_pdl_us": launch_pdl.median_us,
        "copy_gbs": bw / 1e9,
        "copy_bytes": 2 * copy_bytes,
    }


def _method(cfg: RunConfig, cuda: bool) -> list[str]:
    """How the numbers are measured (the page's Method section)."""
    return [
        f"In graph: up to {cfg.graph_calls} back-to-back calls captured in one CUDA graph "
        f"(fewer, down to 8, for slow variants so each stays near {cfg.budget_ms:.0f} ms; "
        f"the counts used are in the JSON), {cfg.warmup} warm-up replays, then the median "
        f"over up to {cfg.reps} timed replays (CUDA events) divided by the calls per graph."
        if cuda
        else "CPU smoke: no graphs, 'graph' times are host-clock eager loops.",
        "Eager: events around the same number of back-to-back calls, same repetitions.",
        "Inputs: fresh random per set (seeded, never zeros); every variant's output is "
        f"poisoned ({POISON}; the attention's outputs NaN), then checked against the reference "
        "variant before timing: bit for bit (compacted DCP rows compared as sorted rows) "
        "unless the op's notes below say otherwise (top-k: as sets of scores; logits: "
        "against fp64 on a subset; attention: against fp32 on the first rows, within the "
        "kit's tolerance).",
        "Rotation: calls cycle through independent input sets, enough for their working "
        "set to reach 2x L2 (at most one set per captured call, 2 GiB in all); cases whose "
        "sets still fit in L2 are flagged with * (cache-resident, as after the producing "
        "kernel in an engine).",
        f"Floor: {FLOOR_RULE} (max: each term alone is a hard lower bound; the sum would "
        "assume no overlap of launch and data movement, false inside a graph).",
    ]


def _run_host(args: argparse.Namespace) -> int:
    """``--ops host``: host microseconds per public call beside a bare Triton launch and
    ``torch.add_`` (``bench/host.py``), into OUT/host.json and OUT/host.txt."""
    from . import host

    backend = select_backend(args.allow_cpu)
    if backend is None:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    cuda = backend.name == "cuda"
    now = _dt.datetime.now()
    out_dir = args.out or Path("results") / f"bench-{now:%Y%m%d-%H%M%S}"
    if not cuda:
        print("** CPU interpreter smoke run (--allow-cpu): the times mean nothing **")
    doc = host.run(out_dir, calls=2000 if cuda else 2, fast=cuda, topk=cuda and not args.quick)
    return 1 if doc.get("fast_launch_mismatches") else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sparse-mla bench",
        description="Per-call times inside a CUDA graph and eagerly, beside the floor "
        "max(empty-kernel launch, bytes / copy bandwidth), all measured in the same run.",
    )
    p.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help=f"comma-separated ops, or 'all' (available: {', '.join(OP_MODULES)}; "
        f"default {','.join(DEFAULT_OPS)}); 'host': the host cost of each public call",
    )
    p.add_argument("--quick", action="store_true", help="a small subset of the grid")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default results/bench-<date>-<time>)",
    )
    p.add_argument(
        "--graph-calls",
        type=int,
        default=RunConfig.graph_calls,
        help="calls captured per CUDA graph and per eager repetition (CPU: at most 2)",
    )
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    p.add_argument(
        "--anchors",
        default="",
        help="comma-separated other implementations to time beside ours, imported by module "
        f"name from your environment ({', '.join(f'{k}: {v}' for k, v in ANCHOR_MODULES.items())})",
    )
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, run a tiny interpreter smoke grid (times meaningless)",
    )
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.graph_calls < 1:
        p.error("--graph-calls must be >= 1")
    unknown = [a for a in _names(args.anchors) if a not in ANCHOR_MODULES]
    if unknown:
        p.error(f"unknown anchor(s) {unknown}; available: {', '.join(ANCHOR_MODULES)}")
    return args


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(
    argv: Sequence[str] | None = None,
    *,
    anchors: Anchors | None = None,
    meta: dict[str, Any] | None = None,
) -> int:
    """Entry point of ``sparse-mla bench``; returns the exit status (0 ok, 1 a variant failed
    or disagreed with its reference, 2 usage error or no CUDA device).

    ``anchors`` replaces what ``--anchors`` would import; ``meta`` entries are added to (or
    replace) the run's recorded metadata (a caller's command line, the commit it ran at)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    ops = resolve_ops(args.ops)
    if "host" in ops:  # its own table (bench/host.py), not a case grid
        ops.remove("host")
        status = _run_host(args)
        if status or not ops:
            return status
    unknown = [o for o in ops if o not in OP_MODULES]
    if unknown or not ops:
        print(
            f"sparse-mla bench: unknown op(s) {unknown}; available: {', '.join(OP_MODULES)}",
            file=sys.stderr,
        )
        return 2
    backend = select_backend(args.allow_cpu)
    if backend is None:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    if anchors is None:
        anchors = import_anchors(_names(args.anchors))
    specs = [load_op(o) for o in ops]
    run, errors, out_dir = _run(args, argv, specs, backend, anchors)
    run.meta.update(meta or {})
    write_runs_json(out_dir / "results.json", [run])
    print(f"wrote {out_dir}/results.json and table.txt in {run.meta['duration_s']} s")
    if errors:
        print(f"{len(errors)} problem(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    return 0


def _run(
    args: argparse.Namespace,
    argv: list[str],
    specs: list[OpSpec],
    backend: Backend,
    anchors: Anchors,
) -> tuple[Run, list[str], Path]:
    """Time every case of ``specs``; print and write the tables. Returns the run, its errors
    and the output directory."""
    cuda = backend.name == "cuda"
    grid = "cpu" if not cuda else ("quick" if args.quick else "full")
    cfg = RunConfig(graph_calls=args.graph_calls)
    if not cuda:
        cfg = RunConfig(graph_calls=min(args.graph_calls, 2), reps=1, warmup=0, budget_ms=50.0)
        print("** CPU interpreter smoke run (--allow-cpu): the times mean nothing **")
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2**31)
    torch.manual_seed(seed)
    now = _dt.datetime.now()
    out_dir = args.out or Path("results") / f"bench-{now:%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    floors = _measure_floors(backend, cfg)
    launch_g, bw = floors["launch_graph_us"], floors["copy_gbs"] * 1e9
    print(
        f"{backend.device_name()} | torch {torch.__version__} triton {triton.__version__} | "
        f"seed {seed} | grid {grid}\n"
        f"empty Triton kernel: {fmt_us(launch_g)} us/call in graph, "
        f"{fmt_us(floors['launch_eager_us'])} us eager, "
        f"{fmt_us(floors['launch_graph_pdl_us'])} us/call in graph "
        f"{'with PDL' if _runtime.pdl_supported(backend.device) else '(no PDL here)'} | "
        f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write, {fmt_bytes(floors['copy_bytes'])}B "
        f"per copy) | L2 {fmt_bytes(backend.l2_bytes)}B"
    )

    results: list[Result] = []
    errors: list[str] = []
    cases = [(spec, c) for spec in specs for c in spec.build(grid, backend.device, anchors)]
    for i, (_, case) in enumerate(cases, 1):
        rs, errs = run_case(case, backend, cfg, launch_g, bw)
        results += rs
        errors += errs
        print(_progress(i, len(cases), case, rs), flush=True)
    for spec in specs:
        spec.cleanup()
    finalize(results)
    summaries = [t for spec in specs for t in spec.summaries(results)]

    versions = _runtime.info()
    meta: dict[str, Any] = dict(ops=[s.name for s in specs], date=now.isoformat(timespec="seconds"))
    meta.update(command="sparse-mla bench " + shlex.join(argv))
    meta.update(process=shlex.join([Path(sys.executable).name, *sys.argv]), commit="")
    meta.update(gpu=backend.device_name(), mode=backend.name, torch=torch.__version__)
    meta.update(triton=triton.__version__, cuda=versions.get("cuda", ""))
    meta.update(sparse_mla=versions.get("sparse_mla", ""), python=platform.python_version())
    meta.update(seed=seed, grid=grid, graph_calls=cfg.graph_calls, reps=cfg.reps)
    meta.update(warmup=cfg.warmup, budget_ms=cfg.budget_ms)
    meta.update(floors, l2_bytes=backend.l2_bytes, floor_rule=FLOOR_RULE)
    meta.update(method=_method(cfg, cuda), op_notes={spec.name: spec.notes for spec in specs})
    meta.update(errors=errors)

    text = []
    for mode in ("eager", "graph"):
        text += [render_text(t) for t in group_tables(results, mode)]
    text += [render_text(t) for t in summaries]
    table_txt = "\n\n".join(text)
    (out_dir / "table.txt").write_text(table_txt + "\n")
    print()
    print(table_txt)
    print()
    meta["duration_s"] = round(time.perf_counter() - t_start, 1)
    return Run(meta, results, summaries), errors, out_dir
