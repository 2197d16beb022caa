"""The verify sweep's machinery: the sweep has the advertised size, and a planted kernel error
fails its case with a label that reproduces it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from sparse_mla import verify
from sparse_mla._runtime import default_device
from sparse_mla.testing.sweep import caches, indices
from sparse_mla.testing.sweep import topk as sweep_topk

DEV = default_device()


def _corrupt(out: torch.Tensor) -> None:
    """Get one element of a kernel's output wrong."""
    if out.dtype == torch.float32:
        out.view(-1)[0] = 12345.0
    elif out.dtype == torch.int32:
        out.view(-1)[0] += 7
    else:  # a bf16 or byte cache: flip one bit
        out.view(torch.uint8).view(-1)[0] ^= 1


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
    # kind: (case filter, the check's module, names in its namespace to wrap)
    "topk": (dict(mode="row"), sweep_topk, ("select_topk",)),
    "kvcache": (dict(cache="indexer_fp8"), caches, ("write_indexer_k", "write_mla_latent")),
    "logits": (dict(fp8=True), caches, ("index_logits",)),
    "remap": ({}, indices, ("convert_req_index_to_global_index",)),
    "dcp": ({}, indices, ("filter_and_convert_dcp_index",)),
}


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_planted_mismatch_is_reported(kind: str, monkeypatch: pytest.MonkeyPatch, capsys):
    where, module, names = PLANTS[kind]
    case = _first_quick(kind, **where)
    assert verify.run_case(case, DEV) is None  # passes as shipped

    for name in names:
        real = getattr(module, name)

        def planted(*args, _real=real, **kwargs):
            res = _real(*args, **kwargs)
            _corrupt(res[0] if isinstance(res, tuple) else res)
            return res

        monkeypatch.setattr(module, name, planted)
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
    # quick sweep in one process, inside tests/test_kernel_compile.py).
    assert verify.main(["--quick", "--kind", "kvcache", "--no-progress", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("kvcache")]
    assert [r[1] for r in rows] == [*verify.KV_CACHES, "(all)"]
    assert rows[-1][2:] == [str(sum(int(r[2]) for r in rows[:-1])), "0"]
    assert verify.main(["--quick", "--case", "-1"]) == 2
