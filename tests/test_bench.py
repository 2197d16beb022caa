"""CPU tests of the benchmark harness (``sparse_mla.bench``). No test asserts a measured time:
timing logic is driven by a fake clock, and the end-to-end runs only check that every stage
(cases, checks, timing, floors, tables, files, plots) ran and agreed with its references."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from sparse_mla import _runtime, choose_remap_layout
from sparse_mla.bench import cases, floor, page, report, runner, timing
from sparse_mla.bench import expand as bench_expand
from sparse_mla.bench import indexer as bench_indexer
from sparse_mla.bench import remap as bench_remap
from sparse_mla.bench import topk as bench_topk
from sparse_mla.bench.report import Result, Table


def _load(out):
    """(meta, results, summaries) of a bench run's output directory (its ops merged)."""
    runs = page.load_runs(out)
    meta = dict(runs[0].meta, ops=[r.meta["ops"][0] for r in runs])
    return meta, [x for r in runs for x in r.results], [t for r in runs for t in r.summaries]


ON_GPU = not _runtime.INTERPRETER and torch.cuda.is_available()
cpu_only = pytest.mark.skipif(ON_GPU, reason="the smoke runs use the CPU interpreter backend")


# --------------------------------------------------------------------------------------------
# A fake clock: every counted call "takes" ms_per_call, every timed run adds fixed_ms.
# --------------------------------------------------------------------------------------------


class FakeBackend(timing.Backend):
    name = "fake"

    def __init__(self, ms_per_call: float = 0.002, fixed_ms: float = 0.0) -> None:
        # The launch-floor kernel really runs: on the GPU when there is one.
        self.device = _runtime.default_device()
        self.l2_bytes = 1000
        self.ms_per_call = ms_per_call
        self.fixed_ms = fixed_ms
        self.calls = 0
        self.captures = 0
        self.log: list[int] = []

    def synchronize(self) -> None:
        pass

    def time_ms(self, fn, reps):
        out = []
        for _ in range(reps):
            before = self.calls
            fn()
            out.append((self.calls - before) * self.ms_per_call + self.fixed_ms)
        return out

    def capture(self, body):
        self.captures += 1
        body()
        return body


def _counting_calls(fb: FakeBackend, n: int):
    def make(i):
        def call():
            fb.calls += 1
            fb.log.append(i)

        return call

    return [make(i) for i in range(n)]


def test_graph_helper_rotates_divides_and_captures_once():
    fb = FakeBackend(ms_per_call=0.002)
    calls = _counting_calls(fb, 3)
    t = timing.measure_graph(calls, graph_calls=7, reps=5, warmup=2, backend=fb)
    assert fb.captures == 1
    assert fb.log[:7] == [0, 1, 2, 0, 1, 2, 0]
    assert fb.calls == 7 * (1 + 2 + 5)  # capture's warm-up + warm-up replays + timed replays
    assert t.calls == 7 and t.reps == 5
    assert t.median_us == pytest.approx(2.0)  # 0.002 ms per call


def test_eager_helper_and_timing_stats():
    fb = FakeBackend(ms_per_call=0.01, fixed_ms=0.04)
    calls = _counting_calls(fb, 2)
    t = timing.measure_eager(calls, n_calls=4, reps=3, warmup=1, backend=fb)
    assert fb.captures == 0
    assert fb.calls == 4 * (1 + 3)
    assert t.median_us == pytest.approx((4 * 0.01 + 0.04) * 1e3 / 4)
    s = timing.Timing.from_samples([3.0, 1.0, 2.0, 10.0, 2.5], calls=9)
    assert (s.median_us, s.min_us, s.max_us, s.reps, s.calls) == (2.5, 1.0, 10.0, 5, 9)
    with pytest.raises(ValueError):
        timing.rotation([], 3)


def test_plan_sizes():
    assert timing.plan_sizes(1.0, max_calls=128, max_reps=30, budget_ms=200) == (128, 30)
    # 1 ms per call: calls drop to the minimum 8 first, then repetitions to fit 200 ms
    assert timing.plan_sizes(1000.0, max_calls=128, max_reps=30, budget_ms=200) == (8, 25)
    assert timing.plan_sizes(50.0, max_calls=128, max_reps=30, budget_ms=200) == (128, 30)
    assert timing.plan_sizes(100.0, max_calls=128, max_reps=30, budget_ms=200) == (66, 30)
    assert timing.plan_sizes(1e6, max_calls=128, max_reps=30, budget_ms=200) == (8, 5)
    assert timing.plan_sizes(1e6, max_calls=2, max_reps=3, budget_ms=1) == (2, 3)


def test_rotation_sets():
    mb = 1 << 20
    assert timing.rotation_sets(mb, 60 * mb, max_sets=128) == 120  # 2 x L2
    assert timing.rotation_sets(200 * mb, 60 * mb, max_sets=128) == 1
    assert timing.rotation_sets(1000, 60 * mb, max_sets=128) == 128
    assert timing.rotation_sets(mb, 60 * mb, max_sets=128, mem_cap_bytes=10 * mb) == 10
    assert timing.rotation_sets(0, 60 * mb, max_sets=128) == 1


def test_copy_bandwidth_and_launch_floor_logic():
    fb = FakeBackend(fixed_ms=0.5)
    bw = timing.measure_copy_bandwidth(fb, 4096, reps=3)
    assert bw == pytest.approx(2 * 4096 / 0.5e-3)  # read + written over the median
    g, e = timing.measure_launch_floor(fb, graph_calls=3, reps=2, warmup=1)
    assert fb.captures == 1 and g.calls == 3 and e.calls == 3


class CaptureFails(FakeBackend):
    def capture(self, body):
        raise RuntimeError("operation not permitted when stream is capturing")


def _toy_case(fb: FakeBackend) -> cases.Case:
    def bind_for(scale):
        def bind(s):
            def call():
                fb.calls += 1
                return s["x"] * scale

            return call

        return bind

    return cases.Case(
        op="toy",
        group="toy",
        plot="toy",
        label="T=4",
        x=4,
        params={},
        make_set=lambda i: {"x": torch.arange(4) + 1 + i},
        set_bytes=400,  # 1000-byte fake L2 -> 5 sets
        variants=[
            cases.Variant("ours", bind_for(2)),
            cases.Variant("wrong", bind_for(3), role="extra"),
            cases.Variant("ref", bind_for(2), role="baseline", graph_safe=False),
        ],
        bytes_moved=lambda sets, v: 4000,
        snapshot=lambda r: r.clone(),
        compare=lambda a, b: "" if torch.equal(a, b) else "mismatch",
        reference="ref",
    )


def test_run_case_checks_rotation_and_capture_failures():
    fb = FakeBackend(ms_per_call=0.001)
    cfg = runner.RunConfig(graph_calls=8, reps=3, warmup=1, budget_ms=100)
    rs, errors = runner.run_case(_toy_case(fb), fb, cfg, launch_us=0.5, bw=1e9)
    by = {r.variant: r for r in rs}
    assert [by[v].check for v in ("ours", "wrong", "ref")] == ["ok", "mismatch", "reference"]
    assert errors == ["toy T=4 wrong: mismatch vs ref"]
    r = by["ours"]
    assert (r.n_sets, r.working_set_bytes, r.l2_bytes) == (5, 2000, 1000)
    assert r.graph_us == pytest.approx(1.0) and r.graph_calls == 8 and r.graph_reps == 3
    assert r.floor_us == pytest.approx(4.0)  # max(0.5 us, 4000 B / 1 GB/s)

    fb = CaptureFails()
    rs, errors = runner.run_case(_toy_case(fb), fb, cfg, launch_us=0.5, bw=1e9)
    by = {r.variant: r for r in rs}
    assert all(r.graph_us is None and r.eager_us is not None for r in rs)
    assert by["ref"].note.startswith("graph capture failed: RuntimeError")
    # our kernels must be graph-safe: their failed capture is an error, the baseline's a note
    assert sum("graph capture failed" in e for e in errors) == 2
    assert not any(e.startswith("toy T=4 ref") for e in errors)


# --------------------------------------------------------------------------------------------
# Floor and byte counting
# --------------------------------------------------------------------------------------------


def test_floor_arithmetic():
    bw = 4.3e12
    assert floor.transfer_us(4.3e6, bw) == pytest.approx(1.0)
    assert floor.floor_us(0.6, 0, bw) == 0.6  # launch-bound
    assert floor.floor_us(0.6, 4.3e6, bw) == pytest.approx(1.0)  # bandwidth-bound: max
    assert floor.floor_us(0.6, 1e6, bw) == 0.6
    assert floor.achieved_gbs(2e9, 1e6) == pytest.approx(2.0)


def test_remap_and_expand_bytes():
    # T=2, K=4, 3 pages: 2*4*4 read + 2*4*4 written + 2*4 req + 3*4 pages (+ 2*4 counts)
    assert floor.remap_bytes(2, 4, 3) == 32 + 32 + 8 + 12 + 8
    assert floor.remap_bytes(2, 4, 3, counts=False) == 32 + 32 + 8 + 12
    # B=2, W=8, T=5: rows read 64 + lens read 16 + rows written 160 + 3 per-token outputs 60
    assert floor.expand_bytes(2, 8, 5, per_token_outputs=3) == 64 + 16 + 160 + 60
    k, t = 2048, 1024  # the planning numbers: ~16.8 MB per call at K=2048, 1024 tokens
    assert floor.remap_bytes(t, k, 0) == 2 * t * k * 4 + 2 * t * 4


def test_count_touched_pages():
    req_id = torch.tensor([0, 0, 1], dtype=torch.int32)
    idx = torch.tensor([[0, 63, 64, -1], [65, 200, -1, -1], [0, 5000, 64, 70]], dtype=torch.int32)
    # request 0: pages {0, 1, 3}; request 1: {0, 1} (page 78 is outside the 4-page table)
    assert floor.count_touched_pages(req_id, idx, block_size=64, max_blocks=4) == 5
    # rank 0 of 2 owns even positions, local p // 2: req 0 -> {0, 1}; req 1 -> {0}
    n = floor.count_touched_pages(
        req_id, idx, block_size=64, max_blocks=4, dcp_size=2, dcp_rank=0, interleave=1
    )
    assert n == 3


def test_remap_set_is_random_and_shaped():
    s = bench_remap.make_remap_set(
        5, 16, width=8, ctx=4096, max_requests=2, device=torch.device("cpu")
    )
    assert s["token_indices"].shape == (5, 16) and s["token_indices"].dtype == torch.int32
    assert s["req_id"].tolist() == [0, 0, 0, 1, 1]
    assert (s["token_indices"] != 0).any() and (s["block_table"] != 0).any()
    idx = s["token_indices"]
    # -1 only as a suffix of each row
    assert all(r[r >= 0].numel() == int((r >= 0).sum()) for r in idx)


def test_ragged_lens_keep_total():
    rng = random.Random(0)
    for total, n in [(2, 2), (17, 3), (4096, 8)]:
        lens = bench_expand.ragged_lens(total, n, rng)
        assert sum(lens) == total and all(1 <= v <= n for v in lens)


# --------------------------------------------------------------------------------------------
# Records, tables, files, plots
# --------------------------------------------------------------------------------------------


def _r(case: str, x: int, variant: str, role: str, g: float | None, e: float, **kw) -> Result:
    d = dict(
        op="remap",
        group="remap K=2048",
        plot="remap_K2048",
        case=case,
        variant=variant,
        role=role,
        series=variant,
        x=x,
        params={"K": 2048, "tokens": x},
        bytes_moved=10**6,
        floor_us=0.6,
        launch_us=0.6,
        copy_gbs=4300.0,
        n_sets=4,
        working_set_bytes=10,
        l2_bytes=100,
        graph_us=g,
        eager_us=e,
        graph_calls=128,
        graph_reps=30,
        check="ok" if role != "baseline" or variant != "torch" else "reference",
    )
    d.update(kw)
    return Result(**d)


def _sample_results() -> list[Result]:
    rs = []
    for x, ours, tiled, seed in [
        (1, 2.0, 3.0, 2.0),
        (256, 2.2, 5.65, 2.5),
        (1024, 3.84, 12.22, 4.0),
    ]:
        rs += [
            _r(f"T={x}", x, "ours", "ours", ours, 10.0),
            _r(f"T={x}", x, "tiled_atomic", "baseline", tiled, 20.0),
            _r(f"T={x}", x, "seed", "baseline", seed, 15.0),
            _r(f"T={x}", x, "torch", "baseline", None, 80.0, note="graph capture failed: x"),
        ]
    report.finalize(rs)
    return rs


def test_finalize_speedups_and_floor_ratio():
    rs = _sample_results()
    ours = rs[0]
    assert ours.speedup_graph == {"tiled_atomic": pytest.approx(1.5), "seed": 1.0}
    assert ours.speedup_eager["torch"] == pytest.approx(8.0)
    assert ours.over_floor == pytest.approx(2.0 / 0.6)
    assert ours.achieved_gbs == pytest.approx(1e6 / 2e-6 / 1e9)
    torch_r = rs[3]
    assert torch_r.best_us == 80.0 and torch_r.speedup_graph == {}


def test_per_step_table_arithmetic():
    t = report.per_step_table(
        _sample_results(),
        group="remap K=2048",
        ours="ours",
        baselines=("tiled_atomic", "seed"),
        tokens=(1, 256, 1024, 9999),
        layers=(61, 78),
    )
    rows = {(r[0], r[1]): r for r in t.rows}
    assert len(rows) == 6  # 9999 is absent
    assert rows[("1", "tiled_atomic")][5:] == ["1.00", "61", "78"]
    assert rows[("256", "tiled_atomic")][5:] == ["3.45", "210", "269"]  # the seed's 270 us/step
    assert rows[("1024", "tiled_atomic")][4] == "3.18x"
    assert rows[("1", "seed")][5:] == ["0.00", "0", "0"]
    # torch has no graph time: both sides fall back to eager times (10 vs 80 us)
    t = report.per_step_table(
        _sample_results(), group="remap K=2048", ours="ours", baselines=("torch",), tokens=(1,)
    )
    assert t.rows == [["1", "torch (eager)", "80.0", "10.0", "8.00x", "70.00", "4270", "5460"]]


def test_tables_and_markdown_render():
    rs = _sample_results()
    (g,) = report.group_tables(rs, "graph")
    (e,) = report.group_tables(rs, "eager")
    assert g.headers[:4] == ["case", "sets", "bytes", "floor us"]
    row = g.rows[0]
    assert row[0] == "T=1" and "n/a" in row  # torch has no graph time
    assert row[g.headers.index("vs tiled_atomic")] == "1.50x"
    assert e.rows[0][e.headers.index("vs torch")] == "8.00x"
    text = report.render_text(g)
    assert text.startswith("== remap K=2048 (graph)") and "ours/floor" in text
    md = report.render_markdown_table(g)
    assert md.splitlines()[0].startswith("| case | sets |") and md.count("\n| T=") == 3
    meta = {
        "ops": ["remap"],
        "gpu": "NVIDIA H200",
        "date": "2026-11-29T10:00:00",
        "torch": "2.11",
        "triton": "3.6",
        "mode": "cuda",
        "seed": 7,
        "command": "sparse-mla bench --ops remap",
        "method": ["in graph: ..."],
        "launch_graph_us": 0.6,
        "launch_eager_us": 5.0,
        "copy_gbs": 4300.0,
        "copy_bytes": 2 << 30,
        "op_notes": {"remap": ["bytes: ..."]},
    }
    steps = report.per_step_table(rs, group="remap K=2048", ours="ours", baselines=("seed",))
    run = page.Run(dict(meta, commit="abc123"), rs, [steps])
    text = page.render_perf_page([run], {"remap_K2048": "perf/remap_K2048.png"})
    for needle in [
        "NVIDIA H200",
        "`sparse-mla bench --ops remap`",
        "torch 2.11, triton 3.6",
        "| commit | abc123 |",
        "![remap_K2048](perf/remap_K2048.png)",
        "per decode step",
        "in graph: ...",
    ]:
        assert needle in text, needle
    assert "mean nothing" not in text


def test_page_record_keeps_the_newest_run_of_each_op(tmp_path):
    rs = _sample_results()
    rs[1].note = 'a "quoted", comma note'
    topk = _ir("topk", "ours", 8.0, N=4096, B=8)
    topk.op = "topk"
    old = page.Run({"date": "2026-11-29T10:00:00", "gpu": "old"}, [*rs, topk])
    new = page.Run(
        {"date": "2026-11-30T10:00:00", "gpu": "new"},
        rs[:1],
        [Table("remap per decode step (K=2048)", ["a"], [["1"]], ["n"])],
    )
    runs = page.latest_per_op([old, new])
    assert [(r.meta["ops"], r.meta["gpu"]) for r in runs] == [(["topk"], "old"), (["remap"], "new")]
    assert runs[1].results == rs[:1] and runs[1].summaries == new.summaries
    page.write_runs_json(tmp_path / "r.json", runs)
    json.loads((tmp_path / "r.json").read_text())  # plain JSON
    back = page.load_runs(tmp_path / "r.json")
    assert [(r.meta, r.results, r.summaries) for r in back] == [
        (r.meta, r.results, r.summaries) for r in runs
    ]
    # a bench output directory, and the page regenerated from the record
    assert runner.main(["--report", str(tmp_path / "r.json"), "--out", str(tmp_path / "d")]) == 0
    assert "## topk" in (tmp_path / "d" / "PERF.md").read_text()
    assert len(page.load_runs(tmp_path / "d")) == 2


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rs = _sample_results()
    rs += [
        _r("B=1", 2, "triton-uniform", "ours", 2.0, 9.0, group="expand n=2", plot="expand"),
        _r("B=1", 2, "torch-ops", "baseline", 30.0, 60.0, group="expand n=2", plot="expand"),
        _r("B=1", 3, "triton-uniform", "ours", 2.0, 9.0, group="expand n=3", plot="expand"),
    ]
    paths = report.write_plots(rs, tmp_path)
    assert sorted(p.name for p in paths) == ["expand.png", "remap_K2048.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fields_helpers():
    class NT(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    x = NT(torch.arange(3), torch.ones(2))
    assert [k for k, _ in cases.tensor_fields(x)] == ["a", "b"]
    snap = cases.clone_fields(x)
    assert cases.compare_fields(snap, cases.clone_fields(x)) == ""
    y = NT(torch.arange(3), torch.zeros(2))
    assert cases.compare_fields(cases.clone_fields(y), snap).startswith("mismatch in b")
    assert cases.compare_fields(cases.clone_fields((x.a, x.b)), snap) == ""  # by position
    assert cases.compare_fields([], snap) == "skipped"


def test_remap_baselines_come_from_benchmarks():
    base = bench_remap.baseline_layouts()
    assert sorted(base) == ["seed", "tiled_atomic"]
    lay = base["seed"](2048, count_valid=True)
    assert (lay.col_tiles, lay.atomic, lay.num_warps, lay.pdl) == (1, False, 8, 0)
    assert base["seed"](384, count_valid=True) == base["tiled_atomic"](384, count_valid=True)
    assert base["tiled_atomic"](384, count_valid=True).col_tiles == 3
    assert base["tiled_atomic"](512, count_valid=False).atomic is False


def test_registry_loads_ops():
    for name in runner.OP_MODULES:
        spec = runner.load_op(name)
        assert spec.name == name and callable(spec.build)


# --------------------------------------------------------------------------------------------
# End to end on the CPU: stand-in ops (harness logic) and the real kernels (interpreter)
# --------------------------------------------------------------------------------------------


def _standin_remap(
    req_id,
    block_table,
    token_indices,
    *,
    block_size=64,
    dcp_size=1,
    dcp_rank=0,
    interleave=1,
    compact=False,
    return_valid_counts=False,
    out=None,
    valid_counts_out=None,
    layout="auto",
    **_,
):
    i = token_indices.long()
    valid = i >= 0
    if dcp_size > 1:
        valid &= (i.clamp_min(0) // interleave) % dcp_size == dcp_rank
        i = (i // (dcp_size * interleave)) * interleave + i % interleave
    page = torch.div(i, block_size, rounding_mode="floor")
    valid &= page < block_table.shape[1]
    safe = page.clamp(0, block_table.shape[1] - 1)
    val = block_table.long()[req_id.long()[:, None], safe] * block_size + i % block_size
    res = torch.where(valid, val, -1)
    if compact and dcp_size > 1:
        res = torch.gather(res, 1, torch.argsort((~valid).to(torch.int8), dim=1, stable=True))
    if layout == "seed" and token_indices.shape[1] == 384:
        res = res + 1  # a planted bug in one variant: the checks must catch it
    res = res.to(torch.int32)
    out = res if out is None else out.copy_(res)
    if not return_valid_counts:
        return out
    counts = valid.sum(1).to(torch.int32)
    if valid_counts_out is not None:
        counts = valid_counts_out.copy_(counts)
    return out, counts


class _Expanded(NamedTuple):
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    decode_lens: torch.Tensor
    req_id: torch.Tensor


def _standin_expand_core(seq_lens, block_table, lens):
    dl = torch.tensor(lens, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(lens)), dl)
    j = torch.arange(req.numel()) - (torch.cumsum(dl, 0) - dl)[req]
    sl = (seq_lens.long()[req] - dl[req] + j + 1).clamp_min(0).to(torch.int32)
    return _Expanded(sl, block_table[req].clone(), torch.ones_like(sl), req.to(torch.int32))


def _standin_expand(
    seq_lens, block_table, decode_lens, *, max_decode_len, num_tokens=None, uniform=None, out=None
):
    lens = decode_lens if not isinstance(decode_lens, int) else [decode_lens] * len(seq_lens)
    lens = lens.tolist() if isinstance(lens, torch.Tensor) else list(lens)
    res = _standin_expand_core(seq_lens, block_table, lens)
    if out is None:
        return res
    for o, r in zip(out, res, strict=True):
        o.copy_(r)
    return out


def _standin_torch_ops(seq_lens, block_table, decode_lens, *, total_tokens=None, num_tokens=None):
    return _standin_expand_core(seq_lens, block_table, decode_lens.tolist())


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(
        bench_remap,
        "_ops",
        lambda: SimpleNamespace(
            convert=_standin_remap,
            dcp=_standin_remap,
            reference=_standin_remap,
            dcp_reference=_standin_remap,
            choose_layout=choose_remap_layout,
            # the stand-in sees the layout's name
            baselines={name: lambda k, name=name, **kw: name for name in ("tiled_atomic", "seed")},
        ),
    )
    monkeypatch.setattr(
        bench_expand,
        "_ops",
        lambda: SimpleNamespace(expand=_standin_expand, torch_ops=_standin_torch_ops),
    )


@cpu_only
def test_smoke_pipeline_with_standins(tmp_path, standins, capsys):
    out = tmp_path / "run"
    rc = runner.main(["--allow-cpu", "--out", str(out), "--seed", "5"])
    captured = capsys.readouterr()
    assert rc == 1  # the planted bug in the seed layout at K=384
    assert "mismatch" in captured.err and "times mean nothing" in captured.out
    meta, rs, summ = _load(out)
    assert meta["mode"] == "cpu" and meta["seed"] == 5 and meta["ops"] == ["expand", "remap"]
    bad = {(r.group, r.variant) for r in rs if r.check.startswith("mismatch")}
    assert bad == {("remap K=384", "seed")}
    assert all(r.check in ("ok", "reference") for r in rs if (r.group, r.variant) not in bad)
    groups = {r.group for r in rs}
    assert groups == {"remap K=256", "remap K=384", "remap DCP=2 K=256", "expand n=2"}
    assert {r.variant for r in rs if r.group == "remap K=256"} == {
        "ours",
        "tiled_atomic",
        "seed",
        "torch",
    }
    assert {r.params["data"] for r in rs if r.op == "expand"} == {"uniform", "ragged"}
    for r in rs:
        assert r.graph_us and r.eager_us and r.floor_us > 0 and r.bytes_moved > 0
        assert r.n_sets >= 1 and r.working_set_bytes >= r.n_sets
    # the ragged case carries the uniform case's token count
    tok = {(r.params["B"], r.params["data"]): r.x for r in rs if r.op == "expand"}
    assert tok[(3, "ragged")] == tok[(3, "uniform")] == 6
    assert len(summ) == 2 and summ[1].title.startswith("remap per decode step (K=384")
    assert summ[0].title.startswith("expansion: ragged kernel vs uniform kernel")
    text = (out / "PERF.md").read_text()
    assert "sparse-mla bench --allow-cpu" in text and "mean nothing" in text
    assert "per decode step" in (out / "table.txt").read_text()


@cpu_only
def test_smoke_pipeline_real_kernels(tmp_path, capsys):
    out = tmp_path / "real"
    rc = runner.main(["--allow-cpu", "--out", str(out), "--seed", "11", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 0, err
    _, rs, _ = _load(out)
    assert rs and all(r.check in ("ok", "reference") for r in rs), [
        (r.group, r.case, r.variant, r.check, r.note)
        for r in rs
        if r.check not in ("ok", "reference")
    ]
    assert not list((out / "perf").glob("*.png"))


@cpu_only
def test_no_cuda_message_and_bad_ops(capsys):
    assert runner.main([]) == 2
    assert "--allow-cpu" in capsys.readouterr().err
    assert runner.main(["--allow-cpu", "--ops", "remap,nope"]) == 2
    assert "unknown op" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Top-k and indexer: byte counts, checks, summaries, smoke runs
# --------------------------------------------------------------------------------------------


def test_topk_and_indexer_bytes():
    # 2 rows of 8 scores, k=4: logits 64 + lengths 8 + positions 32
    assert floor.topk_bytes(2, 8, 4) == 64 + 8 + 32
    # fused epilogue: + counts 8 + req_id 8 + 3 block-table entries 12
    assert floor.topk_bytes(2, 8, 4, counts=True, fused=True, touched_pages=3) == 104 + 28
    # the planning number: 64 rows of 128K scores, k=2048 -> ~34 MB per call
    assert floor.topk_bytes(64, 131072, 2048) == 64 * 131072 * 4 + 64 * 4 + 64 * 2048 * 4
    assert floor.indexer_key_bytes(128, fp8=False) == 256
    assert floor.indexer_key_bytes(128, fp8=True) == 132  # e4m3 values + fp32 scale
    # B=2, n=3, L=128, H=4, D=8, page 64: keys 2*128*16, logits 6*128*4, q 6*4*8*2,
    # weights 6*4*4, block table 2*2*4, seq_lens 2*4
    assert floor.indexer_bytes(2, 3, 128, 4, 8, fp8=False) == 4096 + 3072 + 384 + 96 + 16 + 8
    assert floor.indexer_bytes(2, 3, 128, 4, 8, fp8=True) == 3072 + 3072 + 192 + 96 + 16 + 8
    assert floor.indexer_bytes(2, 3, 128, 4, 8, fp8=True, max_len=256) == 3072 + 6144 + 312
    # keys are read once per request whatever n: n only adds rows (logits, q, weights)
    b1 = floor.indexer_bytes(64, 1, 32768, 64, 128, fp8=False)
    b4 = floor.indexer_bytes(64, 4, 32768, 64, 128, fp8=False)
    assert b4 - b1 == 3 * 64 * (32768 * 4 + 64 * 128 * 2 + 64 * 4)
    assert 0.95 < 64 * 32768 * 256 / b1 < 1  # ~0.5 GB of bf16 keys dominate
    assert floor.copy_fraction(4 * 10**9, 1e6, 4e9) == pytest.approx(1.0)
    assert floor.copy_fraction(10**9, 1e6, 4e9) == pytest.approx(0.25)
    assert [floor.kfmt(v) for v in (512, 1536, 4096, 32768, 131072)] == [
        "512",
        "1536",
        "4K",
        "32K",
        "128K",
    ]


def test_indexer_pages_needed_and_cache_pool(rng):
    full = bench_indexer.GRIDS["full"]
    # bf16: 64 requests x 512 pages; fp8: the largest layer case, 128 x 2048 pages
    assert bench_indexer.pages_needed(full) == {False: 64 * 512, True: 128 * 2048}
    pool = bench_indexer.CachePool()
    dev = _runtime.default_device()  # the writers really run
    c = pool.get(fp8=True, pages=3, page=64, dim=32, device=dev)
    assert c.shape[0] == 3 and c.dtype == torch.uint8 and bool((c != 0).any())
    assert pool.get(fp8=True, pages=2, page=64, dim=32, device=dev) is c
    assert pool.builds == 1  # filled once, shared
    c5 = pool.get(fp8=True, pages=5, page=64, dim=32, device=dev)
    assert c5.shape[0] == 5 and pool.builds == 2  # grown when a case needs more pages
    b = pool.get(fp8=False, pages=2, page=64, dim=32, device=dev)
    assert b.dtype == torch.bfloat16 and pool.builds == 3
    pool.clear()
    assert pool.get(fp8=False, pages=1, page=64, dim=32, device=dev) is not b


def test_topk_and_indexer_gpu_grids_build_lazily():
    # Building the GPU grids allocates nothing (inputs and caches are made per case, later).
    cpu = torch.device("cpu")
    full = bench_topk.build("full", cpu)
    assert len(full) == 12 and {c.params["k"] for c in full} == {2048}
    assert {(c.params["N"], c.params["B"]) for c in full} == {
        (n, b) for n in (4096, 16384, 65536, 131072) for b in (1, 8, 64)
    }
    assert len(bench_topk.build("quick", cpu)) == 4
    cases_ = bench_indexer.build("full", cpu)
    logits = [c for c in cases_ if c.params["kind"] == "logits"]
    layer = [c for c in cases_ if c.params["kind"] == "layer"]
    assert len(logits) == 4 and len(layer) == 27
    assert {(c.params["B"], c.params["ctx"]) for c in logits} == {(64, 32768)}
    n4 = next(c for c in logits if c.params["n"] == 4 and c.params["dtype"] == "fp8")
    assert [v.name for v in n4.variants] == ["native", "flattened"]
    assert all(c.budget_ms == 100.0 and c.params["dtype"] == "fp8" for c in layer)
    assert {len(c.variants) for c in layer if c.params["n"] == 1} == {5}  # no expansion
    # the largest layer set is far beyond L2: one set, no rotation
    big = max(layer, key=lambda c: c.set_bytes)
    assert (big.params["B"], big.params["ctx"], big.params["n"]) == (128, 131072, 4)
    assert timing.rotation_sets(big.set_bytes, 60 << 20, max_sets=128) == 1
    assert len(bench_indexer.build("quick", cpu)) == 4 + 4
    assert bench_indexer.POOL._caches == {}


def test_topk_checker_catches_wrong_selections(rng):
    from sparse_mla.ops.topk.naive import positions_to_slots_reference, select_topk_reference

    k, n = 128, 300
    chk = bench_topk._Checker(k, exact_rows=2, reference=select_topk_reference)
    s = bench_topk.make_topk_set(
        3, n, k, device=torch.device("cpu"), workspace=lambda r, d: torch.zeros(1)
    )
    s = chk.keep(0, s)  # the checker holds set 0 weakly: keep the returned set alive
    assert s["masked"] is s["logits"]  # full rows: no masked copy
    pos = select_topk_reference(s["logits"], s["lengths"], k)
    ref = chk.snapshot(torch.topk(s["masked"], k, dim=1))
    assert ref["self"] == ""
    for ret in (pos.clone(), torch.topk(s["masked"], k, dim=1, sorted=False)):
        snap = chk.snapshot(ret)
        assert snap["self"] == "" and chk.compare(snap, ref) == ""
    slots, counts = positions_to_slots_reference(pos, s["block_table"], s["req_id"], block_size=64)
    fused = chk.snapshot((slots, counts))
    assert fused["self"] == "" and chk.compare(fused, ref) == ""

    def unselected(row: int) -> int:
        return sorted(set(range(n)) - set(pos[row].tolist()))[0]

    bad = pos.clone()
    bad[2, 0] = unselected(2)  # past the exactly-checked rows: the score comparison catches it
    snap = chk.snapshot(bad)
    assert snap["self"] == "" and chk.compare(snap, ref).startswith("mismatch in selected scores")
    bad = pos.clone()
    bad[0, 3] = unselected(0)
    assert "select_topk_reference" in chk.snapshot(bad)["self"]
    bad = pos.clone()
    bad[2, 5] = bench_topk.POISON
    assert "unwritten" in chk.snapshot(bad)["self"]
    bad = pos.clone()
    bad[2, 1] = bad[2, 0]
    assert "duplicated" in chk.snapshot(bad)["self"]
    bad = slots.clone()
    bad[0, 0] = slots[1, 0]  # another request's slot
    assert chk.snapshot((bad, counts))["self"]
    bad_counts = counts.clone()
    bad_counts[1] -= 1
    assert "valid counts" in chk.snapshot((slots, bad_counts))["self"]
    # shorter rows: invisible positions are masked for torch.topk, -1 padding counts as valid
    short = torch.tensor([n, 100, 7], dtype=torch.int32)
    masked = bench_topk.mask_invisible(s["logits"], short)
    assert torch.isneginf(masked[1, 100:]).all() and torch.equal(masked[0], s["logits"][0])


def test_set_ref_does_not_keep_set_zero_alive():
    ref = cases.SetRef()
    s = ref.keep(0, {"x": torch.ones(3)})
    assert ref.keep(1, {"x": torch.zeros(3)}) is not s and ref.get() is s
    assert torch.equal(ref.get()["x"], torch.ones(3))
    del s  # the runner drops its sets when a case ends: so must the checks
    with pytest.raises(RuntimeError, match="gone"):
        ref.get()


def test_layer_check_helpers():
    slots = torch.tensor([[5, 7, -1], [1, -1, -1]], dtype=torch.int32)
    counts = torch.tensor([2, 1], dtype=torch.int32)
    a = bench_indexer._layer_snapshot((slots, counts))
    assert bench_indexer._layer_self_check(a) == "" and bench_indexer._layer_compare(a, a) == ""
    other = bench_indexer._layer_snapshot(torch.zeros(2, 3))  # e.g. the logits stage
    assert other == {} and bench_indexer._layer_self_check(other) == ""
    assert bench_indexer._layer_compare(other, a) == "skipped"
    b = bench_indexer._layer_snapshot((slots.flip(1).contiguous(), counts))
    assert bench_indexer._layer_compare(b, a).startswith("mismatch in slots")
    c = bench_indexer._layer_snapshot((slots, counts + 1))
    assert "counts" in bench_indexer._layer_self_check(c)
    assert bench_indexer._layer_compare(c, a) == "mismatch in valid counts"
    p = slots.clone()
    p[1, 2] = bench_indexer.POISON
    assert "unwritten" in bench_indexer._layer_self_check(
        bench_indexer._layer_snapshot((p, counts))
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_logits_checker_against_fp64(rng, fp8):
    ops = bench_indexer._ops()
    dev = _runtime.default_device()  # the writers really run
    cache = bench_indexer.CachePool().get(fp8=fp8, pages=9, page=64, dim=32, device=dev)
    # ctx 200 is not a page multiple: columns 200..255 must be -inf
    s = bench_indexer.make_logits_set(
        ops, cache, requests=2, n=2, ctx=200, heads=8, dim=32, page=64, fp8=fp8, device=dev
    )
    chk = bench_indexer._LogitsChecker(ops.reference, 2, heads=8, dim=32, fp8=fp8, device=dev)
    s = chk.keep(0, s)
    args = (s["q"], s["weights"], s["cache"])
    native = chk.snapshot(ops.logits(*args, s["seq_lens"], s["block_table"], next_n=2))
    assert native["self"] == ""
    f = s["flat"]
    flat = chk.snapshot(ops.logits(*args, f.seq_lens, f.block_table, next_n=1))
    assert flat["self"] == "" and chk.compare(flat, native) == ""
    x = native["logits"].clone()
    x[3, 10] += 1.0  # request 1, row 1
    assert "err/tol" in chk.vs_reference(x) and chk.compare({"logits": x}, native).startswith(
        "mismatch in logits"
    )
    x = native["logits"].clone()
    x[0, 250] = 0.0  # a column no row can see
    assert "-inf pattern" in chk.vs_reference(x)
    assert chk.compare({"logits": x}, native) == "mismatch in the -inf pattern"
    x = native["logits"].clone()
    x[2, :5] = bench_indexer.POISON
    assert chk.vs_reference(x)


def _ir(kind: str, variant: str, us: float, bytes_moved: int = 10**6, **params) -> Result:
    return Result(
        op="indexer",
        group="g",
        plot="p",
        case="c",
        variant=variant,
        role="ours",
        series=variant,
        x=1,
        params=dict(kind=kind, **params),
        bytes_moved=bytes_moved,
        floor_us=us / 2,
        launch_us=0.5,
        copy_gbs=4000.0,
        graph_us=us,
        eager_us=us * 2,
    )


def test_indexer_and_topk_summaries():
    lay = dict(dtype="fp8", ctx=8192, k=2048)
    rs = [
        _ir("layer", v, t, B=2, n=2, **lay)
        for v, t in [
            ("chain", 10.0),
            ("expand", 1.0),
            ("logits", 5.0),
            ("top-k", 3.0),
            ("remap", 1.5),
            ("top-k+slots", 3.5),
        ]
    ]
    rs += [
        _ir("layer", v, t, B=1, n=1, **lay)
        for v, t in [("chain", 6.0), ("logits", 4.0), ("top-k", 2.0), ("remap", 1.0)]
    ]
    rs += [
        _ir("logits", "native", 100.0, 4 * 10**8, dtype="bf16", B=64, ctx=32768, n=4),
        _ir("logits", "flattened", 300.0, 4 * 10**8, dtype="bf16", B=64, ctx=32768, n=4),
    ]
    report.finalize(rs)
    logits_t, layer_t = bench_indexer.summaries(rs)
    h = logits_t.headers
    native, flat = logits_t.rows
    assert native[h.index("% copy")] == "100%" and native[h.index("GB/s")] == "4000"
    assert flat[h.index("% copy")] == "33%" and flat[h.index("native speedup")] == "3.00x"
    h = layer_t.headers
    one, two = layer_t.rows  # sorted by (ctx, B, n)
    assert one[h.index("expand us")] == "-" and one[h.index("sum us")] == "7.00"
    assert two[h.index("sum us")] == "10.5" and two[h.index("fused sum us")] == "9.50"
    assert two[h.index("chain us")] == "10.0" and two[h.index("chain/floor")] == "2.00x"
    assert two[h.index("sum x61 ms")] == f"{10.5 * 61 / 1e3:.2f}"
    assert one[h.index("top-k+slots us")] == "n/a" and one[h.index("fused sum us")] == "n/a"

    def tr(variant, us):
        r = _ir("topk", variant, us, N=4096, B=8)
        r.op = "topk"
        return r

    rs = [tr("ours", 8.0), tr("ours+slots", 12.0), tr("torch.topk", 30.0)]
    report.finalize(rs)
    (t,) = bench_topk.summaries(rs)
    row = dict(zip(t.headers, t.rows[0], strict=True))
    assert row["N"] == "4K" and row["slots/ours"] == "1.50x"
    assert row["vs torch.topk"] == "3.75x"
    assert row["ours % copy"] == "3%"  # 1 MB in 8 us = 125 GB/s of 4000


def test_resolve_ops_and_case_budget_and_self_check():
    assert runner.resolve_ops("all") == ["remap", "expand", "topk", "indexer"]
    assert runner.resolve_ops("topk, indexer,topk") == ["topk", "indexer"]
    assert runner.parse_args([]).ops == "remap,expand"  # the default set is unchanged
    fb = FakeBackend(ms_per_call=0.001)
    cfg = runner.RunConfig(graph_calls=64, reps=30, warmup=0, budget_ms=100)
    rs, _ = runner.run_case(_toy_case(fb), fb, cfg, launch_us=0.5, bw=1e9)
    assert rs[0].graph_calls == 64
    case = _toy_case(fb)
    case.budget_ms = 0.5  # 1 us calls: 16 calls x 30 reps fit 0.5 ms
    case.self_check = lambda snap: "fp64 check failed" if int(snap.sum()) == 20 else ""
    rs, errors = runner.run_case(case, fb, cfg, launch_us=0.5, bw=1e9)
    by = {r.variant: r for r in rs}
    assert by["ours"].graph_calls == 16 and by["ours"].graph_reps == 30
    # the self check applies to the reference too
    assert by["ref"].check == by["ours"].check == "mismatch: fp64 check failed"
    assert by["wrong"].check == "mismatch"
    assert any(e.startswith("toy T=4 ref: mismatch: fp64") for e in errors)


@cpu_only
def test_smoke_topk_indexer_real_kernels(tmp_path, capsys):
    out = tmp_path / "ti"
    argv = ["--allow-cpu", "--ops", "topk,indexer", "--out", str(out), "--seed", "13"]
    rc = runner.main([*argv, "--graph-calls", "1", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 0, err
    meta, rs, summ = _load(out)
    assert meta["ops"] == ["indexer", "topk"] and meta["mode"] == "cpu"
    assert not [
        (r.group, r.case, r.variant, r.check, r.note)
        for r in rs
        if r.check not in ("ok", "reference", "skipped") or r.note
    ]
    # only the layer stages whose outputs are not slots have nothing to compare with
    assert {r.variant for r in rs if r.check == "skipped"} == {"expand", "logits", "top-k"}
    top = [r for r in rs if r.op == "topk"]
    assert {r.variant for r in top} == {"ours", "ours+slots", "torch.topk"}
    assert {r.params["N"] for r in top} == {512, 2048}  # 2048 with num_splits=2: split path
    logits = [r for r in rs if r.params.get("kind") == "logits"]
    assert {(r.params["dtype"], r.params["n"], r.variant) for r in logits} == {
        (d, n, v)
        for d in ("bf16", "fp8")
        for n, v in [(1, "native"), (4, "native"), (4, "flattened")]
    }
    layer = [r for r in rs if r.params.get("kind") == "layer"]
    assert {(r.params["n"], r.variant) for r in layer} == {
        (n, v)
        for n in (1, 2)
        for v in ("chain", "expand", "logits", "top-k", "remap", "top-k+slots")
        if n > 1 or v != "expand"
    }
    for r in rs:
        assert r.graph_us and r.eager_us and r.floor_us > 0 and r.bytes_moved > 0
    chain = next(r for r in layer if r.variant == "chain" and r.params["n"] == 2)
    stages = [r for r in layer if r.params["n"] == 2 and r.variant in bench_indexer.LAYER_STAGES]
    assert chain.bytes_moved == sum(r.bytes_moved for r in stages)
    titles = [t.title for t in summ]
    assert titles[0].startswith("indexer logits") and titles[1].startswith("indexer side per layer")
    assert titles[2].startswith("top-k: ours vs torch.topk")
    assert len(summ[1].rows) == 2
    text = (out / "PERF.md").read_text()
    assert "indexer side per layer" in text and "% copy" in text and "fp64" in text
    assert bench_indexer.POOL._caches == {}  # the shared caches are freed after the run


def _standin_select(
    logits,
    lengths,
    *,
    k=2048,
    out=None,
    block_table=None,
    req_id=None,
    block_size=64,
    return_valid_counts=False,
    valid_counts_out=None,
    workspace=None,
    num_splits=None,
):
    from sparse_mla.ops.topk.naive import positions_to_slots_reference, select_topk_reference

    pos = select_topk_reference(logits, lengths, k)
    if block_table is None:
        return out.copy_(pos)
    slots, counts = positions_to_slots_reference(pos, block_table, req_id, block_size=block_size)
    if logits.shape[1] == 2048:
        slots[-1, 0] += 1  # a planted bug in the fused epilogue: the checks must catch it
    out.copy_(slots)
    valid_counts_out.copy_(counts)
    return out, valid_counts_out


@cpu_only
def test_smoke_topk_standin_planted_bug(tmp_path, monkeypatch, capsys, seed):
    from sparse_mla.ops.topk.naive import select_topk_reference

    monkeypatch.setattr(
        bench_topk,
        "_ops",
        lambda: SimpleNamespace(
            select=_standin_select,
            workspace=lambda rows, device: torch.zeros(1, dtype=torch.int32),
            reference=select_topk_reference,
        ),
    )
    out = tmp_path / "tk"
    argv = ["--allow-cpu", "--ops", "topk", "--out", str(out), "--seed", str(seed)]
    rc = runner.main([*argv, "--no-plots"])
    assert rc == 1 and "mismatch" in capsys.readouterr().err
    _, rs, _ = _load(out)
    assert {(r.group, r.variant) for r in rs if r.check.startswith("mismatch")} == {
        ("topk N=2K k=128", "ours+slots")
    }


def test_host_cost_table_with_stubbed_launches():
    # The wrappers' own cost (kernels stubbed out): every public call is timed and counted.
    from sparse_mla.bench import host

    res = host.measure_host_costs(torch.device("cpu"), calls=2, stub=True, topk_cols=4096)
    by = {r.name: r for r in res}
    assert res[0].name.startswith("bare") and by["torch.add_"].launches == 0
    assert by["convert_req_index_to_global_index"].launches == 1
    assert all(r.launches >= 1 and r.budget_us for r in res if r.name.split()[0] in (
        "select_topk", "sparse_mla_decode", "index_logits", "write_mla_latent"))  # fmt: skip
    text = host.render(res, "t")
    assert "x budget" in text and "DecodeMetadataBuilder.build (ragged)" in text


def test_bench_host_op_is_its_own_table(monkeypatch, tmp_path):
    from sparse_mla.bench import host

    seen = {}
    monkeypatch.setattr(host, "run", lambda out, **kw: seen.update(out=out, **kw) or {})
    assert runner.main(["--allow-cpu", "--ops", "host", "--out", str(tmp_path)]) == 0
    assert seen["out"] == tmp_path and seen["fast"] is False
    assert runner.main(["--ops", "host"]) == 2  # no GPU, no --allow-cpu
