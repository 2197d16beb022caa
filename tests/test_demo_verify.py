"""The demo's decode-step pipeline and the verify sweep's machinery: the pipeline passes on a
small batch and reports a planted corruption; the sweep has the advertised size, and a planted
kernel error fails its case with a label that reproduces it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from sparse_mla import demo, verify
from sparse_mla._runtime import default_device

DEV = default_device()
# A small batch: 5 requests (n_b 1..4, one shorter than k) + 2 padding requests, contexts to 1K.
TINY = dataclasses.replace(
    demo.SIZES["small"], name="tiny", requests=5, min_context=100, max_context=1024, k=128
)
STAGES = (
    "metadata: ragged -> flattened",
    "metadata: DCP-local lengths, 2 ranks",
    "cache fill: indexer K bf16",
    "cache fill: indexer K fp8 132 B",
    "cache fill: MLA latent fp8 656 B",
    "step write: MLA latent fp8 (pad -1)",
    "logits fp8, flattened",
    "top-k k=128 (fp8 logits)",
    "remap -> global slots",
    "top-k + fused slot epilogue",
    "DCP filter + compact, rank 0/2",
    "DCP filter + compact, rank 1/2",
    "DCP: union of ranks = selection",
    "metadata: uniform n=2 -> native",
    "top-k + fused slots, native rows",
)


# ---- demo ------------------------------------------------------------------------------------


def test_decode_step_passes(seed: int, monkeypatch: pytest.MonkeyPatch, capsys):
    """The pipeline, as ``sparse-mla demo`` runs it, on a small batch: every stage passes."""
    stages = demo.decode_step(TINY, seed, log=lambda *_: None)
    lines: list[str] = []
    demo.print_stages(stages, log=lines.append)
    assert stages and all(s.ok for s in stages), "\n".join(lines)
    names = [s.name for s in stages]
    for name in STAGES:
        assert name in names, (name, names)
    assert all(s.time == "-" or s.time.endswith(("interp", "us")) for s in stages)

    # main() prints the same table and ends with the verdict line.
    monkeypatch.setattr(demo, "decode_step", lambda size, seed, log=print: stages)
    assert demo.main(["--skip-verify", "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "demo: PASS"
    assert "worked examples  PASS" in out and "decode step      PASS" in out
    assert all(name in out for name in STAGES)


def _corrupt(out: torch.Tensor) -> None:
    """Get one element of a kernel's output wrong."""
    if out.dtype == torch.float32:
        out.view(-1)[0] = 12345.0
    elif out.dtype == torch.int32:
        out.view(-1)[0] += 7
    else:  # a bf16 or byte cache: flip one bit
        out.view(torch.uint8).view(-1)[0] ^= 1


def test_demo_main_reports_planted_error(monkeypatch: pytest.MonkeyPatch, capsys):
    """A top-k kernel that gets one element wrong fails its stage, the demo and the exit code."""
    monkeypatch.setitem(demo.SIZES, "small", TINY)
    monkeypatch.setitem(demo.SIZES, "v32", TINY)
    real = demo.select_topk

    def bad_topk(*args, **kwargs):
        res = real(*args, **kwargs)
        _corrupt(res[0] if isinstance(res, tuple) else res)
        return res

    monkeypatch.setattr(demo, "select_topk", bad_topk)
    assert demo.main(["--skip-verify", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "demo: FAIL"
    failed = [line for line in out.splitlines() if " FAIL " in line]
    assert any("top-k k=128 (fp8 logits)" in line for line in failed), out
    assert any("top-k + fused slots, native rows" in line for line in failed), out
    # The stages that do not involve top-k still pass.
    assert any("logits fp8, flattened" in line and "PASS" in line for line in out.splitlines())


def test_decode_step_crash_fails_its_stage(monkeypatch: pytest.MonkeyPatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(demo, "index_logits", broken)
    stages = demo.decode_step(TINY, 0, log=lambda *_: None)
    assert all(s.ok for s in stages[:-1])
    last = stages[-1]
    assert last.name == "logits bf16, flattened" and not last.ok
    assert "RuntimeError: kernel exploded" in last.verdict


# ---- verify: the sweep ----------------------------------------------------------------------


def test_build_cases_counts():
    full = verify.build_cases(quick=False)
    quick = verify.build_cases(quick=True)
    kinds = Counter(c.kind for c in full)
    # The seed PR's 1728 remap configurations, and more (DCP layouts, expansion).
    assert kinds["remap"] + kinds["dcp"] + kinds["expand"] >= 1728
    n_topk = len(verify.TOPK_DISTS) * 2 * len(verify.TOPK_MODES) * verify.TOPK_REPS
    assert kinds["topk"] == n_topk
    assert kinds["kvcache"] == len(verify.KV_CACHES) * 2 * verify.KV_REPS
    assert kinds["logits"] == 2 * len(verify.FULL_SIZES.logits_next_n) * verify.LOGITS_REPS
    seeds = [c.seed for c in full]
    assert seeds == list(range(len(full)))  # unique, reproducible by number
    assert [c.seed for c in verify.build_cases(False, base_seed=1000)][:3] == [1000, 1001, 1002]

    # The quick subset keeps the full sweep's numbering, every kind and, for top-k, every
    # distribution x mode; at interpreter sizes.
    by_seed = {c.seed: c for c in full}
    assert all(by_seed[c.seed].kind == c.kind for c in quick)
    qk = Counter(c.kind for c in quick)
    assert set(qk) == set(verify.RUNNERS)
    assert len(quick) < len(full) // 3
    topk = [c for c in quick if c.kind == "topk"]
    assert {(c.params["dist"], c.params["mode"]) for c in topk} == {
        (d, m) for d in verify.TOPK_DISTS for m in verify.TOPK_MODES
    }
    assert {c.params["k"] for c in topk} == {128, 256}
    assert {c.params["k"] for c in full if c.kind == "topk"} == {512, 2048}
    assert max(c.params["max_n"] for c in topk) <= 2000
    assert {c.params["heads"] for c in quick if c.kind == "logits"} == {8}
    assert {c.params["heads"] for c in full if c.kind == "logits"} == {64}


def test_chunks_cover_every_case_heaviest_first():
    cases = verify.build_cases(quick=True)
    chunks = verify._chunks(cases)
    flat = [c for ch in chunks for c in ch]
    assert sorted(c.seed for c in flat) == sorted(c.seed for c in cases)
    costs = [verify._COST[c.kind] for c in flat]
    assert costs == sorted(costs, reverse=True)
    assert all(sum(verify._COST[c.kind] for c in ch) <= 8 for ch in chunks)


def _first_quick(kind: str, **params) -> verify.Case:
    for c in verify.build_cases(quick=True):
        if c.kind == kind and all(c.params[k] == v for k, v in params.items()):
            return c
    raise AssertionError(f"no quick {kind} case with {params}")


PLANTS = {
    # kind: (case filter, names in verify's namespace to wrap)
    "topk": (dict(mode="row"), ("select_topk",)),
    "kvcache": (dict(cache="indexer_fp8"), ("write_indexer_k", "write_mla_latent")),
    "logits": (dict(fp8=True), ("index_logits",)),
    "remap": ({}, ("convert_req_index_to_global_index",)),
    "dcp": ({}, ("filter_and_convert_dcp_index",)),
}


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_planted_mismatch_is_reported(kind: str, monkeypatch: pytest.MonkeyPatch, capsys):
    where, names = PLANTS[kind]
    case = _first_quick(kind, **where)
    assert verify.run_case(case, DEV) is None  # passes as shipped

    for name in names:
        real = getattr(verify, name)

        def planted(*args, _real=real, **kwargs):
            res = _real(*args, **kwargs)
            _corrupt(res[0] if isinstance(res, tuple) else res)
            return res

        monkeypatch.setattr(verify, name, planted)
    err = verify.run_case(case, DEV)
    assert err is not None and "raised" not in err, err

    # The sweep prints the failing case's label (with its seed) and how to rerun it.
    assert verify.main(["--quick", "--case", str(case.seed), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {case.label()}: " in out
    assert f"seed={case.seed}" in case.label()
    assert "sparse-mla verify --quick --seed 0 --case SEED" in out


def test_summary_groups_by_kind(capsys):
    # Two worker processes: the path `sparse-mla verify --jobs N` takes (make test runs the
    # quick sweep in one process, inside tests/test_sm90_compile.py).
    assert verify.main(["--quick", "--kind", "kvcache", "--no-progress", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("kvcache")]
    assert [r[1] for r in rows] == [*verify.KV_CACHES, "(all)"]
    assert rows[-1][2:] == [str(sum(int(r[2]) for r in rows[:-1])), "0"]
    assert verify.main(["--quick", "--case", "-1"]) == 2
