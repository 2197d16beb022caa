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

from sparse_mla import _runtime
from sparse_mla.bench import cases, floor, report, runner, timing
from sparse_mla.bench import expand as bench_expand
from sparse_mla.bench import remap as bench_remap
from sparse_mla.bench.report import Result, Table

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
    page = report.render_markdown_page(meta, rs, [steps], {"remap_K2048": "plots/remap_K2048.png"})
    for needle in [
        "NVIDIA H200",
        "`sparse-mla bench --ops remap`",
        "2.11 / 3.6",
        "![remap_K2048](plots/remap_K2048.png)",
        "## Eager",
        "per decode step",
        "graph capture failed",
    ]:
        assert needle in page, needle
    assert "mean nothing" not in page


def test_json_and_csv_round_trip(tmp_path):
    rs = _sample_results()
    rs[1].note = 'a "quoted", comma note'
    meta = {"gpu": "x", "seed": 1}
    summ = [Table("t", ["a", "b"], [["1", "2"]], ["n"])]
    report.write_json(tmp_path / "r.json", meta, rs, summ)
    meta2, rs2, summ2 = report.load_json(tmp_path / "r.json")
    assert meta2 == meta and rs2 == rs and summ2 == summ
    report.write_csv(tmp_path / "r.csv", rs)
    assert report.read_csv(tmp_path / "r.csv") == rs
    json.loads((tmp_path / "r.json").read_text())  # plain JSON


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

    def f(a, *, keep=1):
        return a

    assert cases.kwargs_filter(f)({"keep": 2, "drop": 3}) == {"keep": 2}


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
    meta, rs, summ = report.load_json(out / "results.json")
    assert meta["mode"] == "cpu" and meta["seed"] == 5 and meta["ops"] == ["remap", "expand"]
    bad = {(r.group, r.variant) for r in rs if r.check.startswith("mismatch")}
    assert bad == {("remap K=384", "seed")}
    assert all(r.check in ("ok", "reference") for r in rs if (r.group, r.variant) not in bad)
    groups = {r.group for r in rs}
    assert groups == {"remap K=256", "remap K=384", "remap DCP=2 K=256", "expand n=2"}
    assert {r.variant for r in rs if r.group == "remap K=256"} == {
        "ours",
        "ours-nocount",
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
    assert len(summ) == 2 and summ[0].title.startswith("remap per decode step (K=384")
    assert summ[1].title.startswith("expansion: ragged kernel vs uniform kernel")
    assert report.read_csv(out / "results.csv") == rs
    page = (out / "results.md").read_text()
    assert "sparse-mla bench --allow-cpu" in page and "mean nothing" in page
    assert "per decode step" in (out / "table.txt").read_text()


@cpu_only
def test_smoke_pipeline_real_kernels(tmp_path, capsys):
    out = tmp_path / "real"
    rc = runner.main(["--allow-cpu", "--out", str(out), "--seed", "11", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 0, err
    _, rs, _ = report.load_json(out / "results.json")
    assert rs and all(r.check in ("ok", "reference") for r in rs), [
        (r.group, r.case, r.variant, r.check, r.note)
        for r in rs
        if r.check not in ("ok", "reference")
    ]
    assert not (out / "plots").exists()


@cpu_only
def test_no_cuda_message_and_bad_ops(capsys):
    assert runner.main([]) == 2
    assert "--allow-cpu" in capsys.readouterr().err
    assert runner.main(["--allow-cpu", "--ops", "remap,nope"]) == 2
    assert "unknown op" in capsys.readouterr().err
