"""The V4 decode-step benchmark (``benchmarks/gpu_v4_step.py``) end to end at toy sizes on the
CPU (Triton interpreter): every point checked then timed, HF's attention beside it, the JSON
and the PERF section written; a wrong step is not timed; points over the memory budget are
skipped, saying so."""

from __future__ import annotations

import json

from benchmarks import gpu_v4_step
from sparse_mla.decode import V4_STAGES


def test_toy_run_checks_times_and_writes_the_perf_section(tmp_path):
    assert gpu_v4_step.main(["--toy", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "v4_step.json").read_text())
    rows = {r["kind"]: r for r in data["rows"]}
    assert sorted(rows) == ["csa", "hca", "sliding"] and data["failures"] == []
    assert all(r["check"] == "PASS" for r in rows.values())
    csa = rows["csa"]
    assert all(csa[f"{s} us"] > 0 and csa["floor us"][s] > 0 for s in V4_STAGES)
    assert "top-k us" not in rows["hca"] and "compressors us" not in rows["sliding"]
    for r in rows.values():
        assert r["step us"] > 0 and r["step eager us"] > 0 and r["torch us"] > 0
        assert r["hf us"] > 0, r.get("hf note")  # (transformers is in the test extra)
        assert r["hf eager us"] > 0 and r["hf projections us"] > 0
    md = (tmp_path / "v4_step.md").read_text()
    assert "| h | B | context | n | metadata | window write | compressors |" in md
    assert "Per model step" in md and "| 4 | 2 | 96 | 2 |" in md


def test_a_wrong_step_is_not_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_v4_step, "v4_step_error", lambda *a: "planted difference")
    argv = ["--toy", "--kinds", "sliding", "--skip-hf", "--out", str(tmp_path)]
    assert gpu_v4_step.main(argv) == 1
    (row,) = json.loads((tmp_path / "v4_step.json").read_text())["rows"]
    assert row["check"] == "FAIL: planted difference" and "step us" not in row


def test_points_over_the_memory_budget_are_skipped(tmp_path):
    assert gpu_v4_step.main(["--toy", "--mem-gb", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "v4_step.json").read_text())["rows"]
    assert len(rows) == 3 and all(r["note"].startswith("skipped: state and") for r in rows)
    assert "skipped: state and" in (tmp_path / "v4_step.md").read_text()
