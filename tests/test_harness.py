"""CPU tests of the repository's performance machinery (``benchmarks/harness``): the PERF page,
its record and plots, the checkout's anchors, and a harness run end to end."""

from __future__ import annotations

import json
import sys

import pytest
from test_bench import _load, _planted, _r, _sample_results, cpu_only  # (this folder)

from benchmarks.harness import __main__ as harness
from benchmarks.harness import anchors, page, plots
from sparse_mla.bench import record, report
from sparse_mla.bench import remap as bench_remap
from sparse_mla.bench.record import Run
from sparse_mla.bench.report import Table


def test_remap_baselines_of_the_checkout():
    base = anchors.remap_layouts()
    assert sorted(base) == ["seed", "tiled_atomic"]
    lay = base["seed"](2048, count_valid=True)
    assert (lay.col_tiles, lay.atomic, lay.num_warps, lay.pdl) == (1, False, 8, 0)
    assert base["tiled_atomic"](384, count_valid=True).col_tiles == 3
    found = anchors.repo_anchors(cuda=False)  # no attention anchor off a GPU
    assert (
        found.flashmla is None
        and found.vllm is None
        and sorted(found.remap_layouts)
        == [
            "seed",
            "tiled_atomic",
        ]
    )
    assert found.notes == ["anchors: not run (no CUDA device)"]


def test_page_render_merge_and_record(tmp_path, monkeypatch):
    rs = _sample_results()
    meta = dict(ops=["remap"], gpu="NVIDIA H200", date="2026-11-29T10:00:00", torch="2.11")
    meta.update(triton="3.6", mode="cuda", commit="abc123", method=["in graph: ..."])
    meta.update(command="sparse-mla bench --ops remap", launch_graph_us=0.6, copy_gbs=4300.0)
    steps = report.per_step_table(rs, group="remap K=2048", ours="ours", baselines=("seed",))
    text = page.render_perf_page([Run(meta, rs, [steps])], {"remap_K2048": "perf/x.png"})
    needles = ["NVIDIA H200", "`sparse-mla bench --ops remap`", "torch 2.11, triton 3.6"]
    needles += ["| commit | abc123 |", "![remap_K2048](perf/x.png)", "per decode step", "in graph"]
    assert [n for n in needles if n not in text] == []
    assert "mean nothing" not in text

    rs[1].note = 'a "quoted", comma note'
    topk = _r("c", 1, "ours", "ours", 8.0, 9.0, op="topk", group="g", plot="p")
    old = Run({"date": "2026-11-29T10:00:00", "gpu": "old"}, [*rs, topk])
    summary = Table("remap per decode step (K=2048)", ["a"], [["1"]], ["n"])
    new = Run({"date": "2026-11-30T10:00:00", "gpu": "new"}, rs[:1], [summary])
    runs = page.latest_per_op([old, new])
    assert [(r.meta["ops"], r.meta["gpu"]) for r in runs] == [(["topk"], "old"), (["remap"], "new")]
    assert runs[1].results == rs[:1] and runs[1].summaries == [summary]
    record.write_runs_json(tmp_path / "r.json", runs)
    json.loads((tmp_path / "r.json").read_text())  # plain JSON
    back = record.load_runs(tmp_path / "r.json")
    assert [(r.meta, r.results, r.summaries) for r in back] == [
        (r.meta, r.results, r.summaries) for r in runs
    ]
    # the page regenerated from the record, then read back from the output directory
    out = tmp_path / "docs"
    assert (
        harness.main(["--report", str(tmp_path / "r.json"), "--out", str(out), "--no-plots"]) == 0
    )
    assert "## topk" in (out / "PERF.md").read_text() and len(record.load_runs(out)) == 2
    (out / "PERF.md").unlink()
    monkeypatch.chdir(tmp_path)  # no SRC, no --out: docs/perf/results.json into docs/
    assert harness.main(["--report", "--no-plots"]) == 0 and (out / "PERF.md").exists()
    assert harness.main(["--report", "--ops", "remap"]) == 2  # --report times nothing


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rs = _sample_results()
    rs += [
        _r("B=1", 2, "triton-uniform", "ours", 2.0, 9.0, group="expand n=2", plot="expand"),
        _r("B=1", 2, "torch-ops", "baseline", 30.0, 60.0, group="expand n=2", plot="expand"),
        _r("B=1", 3, "triton-uniform", "ours", 2.0, 9.0, group="expand n=3", plot="expand"),
    ]
    paths = plots.write_plots(rs, tmp_path)
    assert sorted(p.name for p in paths) == ["expand.png", "remap_K2048.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_anchor_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the importers prepend their folders
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(anchors, "ROOT", tmp_path / "repo")
    monkeypatch.setenv("FLASHMLA_PATH", str(tmp_path / "nowhere"))
    for mod, why in (anchors.import_flashmla(), anchors.import_vllm()):
        assert mod is None and "not found" in why
    (tmp_path / ".anchors").mkdir()
    (tmp_path / ".anchors" / "vllm_triton_sparse_mla.py").write_text("raise ImportError('x')\n")
    mod, why = anchors.import_vllm()
    assert mod is None and "did not import: x" in why
    (tmp_path / "fm" / "flash_mla").mkdir(parents=True)
    (tmp_path / "fm" / "flash_mla" / "__init__.py").write_text("ANCHOR = 1\n")
    monkeypatch.setenv("FLASHMLA_PATH", str(tmp_path / "fm"))
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # removed again after the test
    del sys.modules["flash_mla"]
    mod, why = anchors.import_flashmla()
    assert why is None and mod.ANCHOR == 1


@cpu_only
def test_smoke_remap_expand(tmp_path, capsys, monkeypatch):
    # a planted bug in our remap at K=384 only: the checks must catch exactly that
    when = lambda args, kw: kw.get("layout") == "auto" and args[2].shape[1] == 384  # noqa: E731
    _planted(bench_remap, "convert", when, monkeypatch)
    out = tmp_path / "run"
    rc = harness.main(["--allow-cpu", "--out", str(out), "--seed", "5", "--no-plots"])
    captured = capsys.readouterr()
    assert rc == 1 and "mismatch" in captured.err and "times mean nothing" in captured.out
    meta, rs, summ = _load(out / "perf")  # the page's record: one run per op, in page order
    assert meta["mode"] == "cpu" and meta["seed"] == 5 and meta["ops"] == ["expand", "remap"]
    bad = {(r.group, r.variant) for r in rs if r.check.startswith("mismatch")}
    assert bad == {("remap K=384", "ours")}
    others = [r for r in rs if (r.group, r.variant) not in bad]
    assert all(r.check in ("ok", "reference") and not r.note for r in others)
    groups = {"remap K=256", "remap K=384", "remap DCP=2 K=256", "expand n=2"}
    assert {r.group for r in rs} == groups
    variants = {r.variant for r in rs if r.group == "remap DCP=2 K=256"}
    assert variants == {"ours", "tiled_atomic", "seed", "torch"}
    for r in rs:
        assert r.graph_us and r.eager_us and r.floor_us > 0 and r.bytes_moved > 0
        assert r.n_sets >= 1 and r.working_set_bytes >= r.n_sets
    # the ragged case carries the uniform case's token count
    tok = {(r.params["B"], r.params["data"]): r.x for r in rs if r.op == "expand"}
    assert tok[(3, "ragged")] == tok[(3, "uniform")] == 6
    assert [t.title[:22] for t in summ] == ["expansion: ragged kern", "remap per decode step "]
    assert "(K=384" in summ[1].title  # the largest K of the CPU grid
    text = (out / "PERF.md").read_text()
    assert "python -m benchmarks.harness --allow-cpu" in text and "mean nothing" in text
    assert meta["commit"]  # the checkout's, recorded by the harness
    assert "per decode step" in (out / "table.txt").read_text()
    assert not list((out / "perf").glob("*.png"))
