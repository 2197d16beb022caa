"""CPU tests of the bench's optional baselines (FlashInfer's top-k, DeepGEMM's paged indexer
logits): skipped cleanly where they do not import, and their correctness checks driven by
stand-ins with the real calling conventions (unordered outputs, other tie choices, garbage
where the contract allows it, planted errors). The real modules are GPU-only; the GPU run is
``.anchors/flashinfer/run.sh``."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from test_bench import _load, cpu_only  # (this folder)

from benchmarks.harness import anchors as harness
from sparse_mla import _runtime
from sparse_mla.bench import indexer as bench_indexer
from sparse_mla.bench import runner
from sparse_mla.bench import topk as bench_topk
from sparse_mla.bench.anchors import Anchors, import_anchors
from sparse_mla.ops.indexer.naive import index_logits_reference
from sparse_mla.ops.topk.naive import select_topk_reference
from sparse_mla.testing import timing

FI_NAMES = {
    bench_topk.FLASHINFER,
    bench_topk.FI_TIE,
    bench_topk.FI_RADIX,
    bench_topk.FI_CUB,
    bench_topk.FI_SLOTS,
    bench_topk.FI_PLAIN,
}


def _select(x: torch.Tensor, lengths: torch.Tensor, k: int, low_first: bool) -> torch.Tensor:
    """An exact top-k written in reverse order (unordered for the checker), ties at the k-th
    broken towards low (``low_first``) or high positions; -1 past each row's count."""
    out = torch.full((x.shape[0], k), -1, dtype=torch.int32)
    for r in range(x.shape[0]):
        row = x[r, : int(lengths[r])]
        if not low_first:
            row = row.flip(0)
        idx = torch.sort(row, descending=True, stable=True).indices[:k]
        if not low_first:
            idx = row.numel() - 1 - idx
        out[r, : idx.numel()] = idx.flip(0).int()
    return out


def fake_flashinfer(algos: list, *, wrong: bool = False) -> SimpleNamespace:
    """FlashInfer's top-k entries as the bench calls them (``tie_break=0``: the high position
    among ties, unlike ours); records ``FLASHINFER_TOPK_ALGO`` at each call; ``wrong``: the
    ragged transform swaps one selected position of the last row for an unselected one."""

    def ragged(x, offsets, lengths, k, tie_break=0):
        algos.append(os.environ.get(bench_topk.FI_ALGO_ENV))
        pos = _select(x.cpu(), lengths.cpu(), k, low_first=tie_break == 1).to(x.device)
        if wrong:
            rest = sorted(set(range(x.shape[1])) - set(pos[-1].tolist()))
            pos[-1, 0] = rest[0]
        return torch.where(pos >= 0, pos + offsets[:, None], -1).int()

    def page_table(x, src_page_table, lengths, k, row_to_batch=None, page_size=1, out=None):
        pos = _select(x.cpu(), lengths.cpu(), k, low_first=False).to(x.device).long()
        rows = torch.arange(x.shape[0]) if row_to_batch is None else row_to_batch.long()
        page = src_page_table[rows[:, None], pos.clamp(min=0) // page_size].long()
        out.copy_(torch.where(pos >= 0, page * page_size + pos % page_size, -1))
        return out

    def top_k(x, k):
        full = torch.full((x.shape[0],), x.shape[1])
        idx = _select(x.cpu(), full, k, low_first=False).to(x.device).long()
        return x.gather(1, idx), idx

    return SimpleNamespace(
        __version__="fake",
        top_k_ragged_transform=ragged,
        top_k_page_table_transform=page_table,
        top_k=top_k,
    )


def test_absent_baselines_are_skipped_with_a_note(monkeypatch):
    for module in ("flashinfer", "deep_gemm"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    found = import_anchors(["flashinfer", "deepgemm"])
    assert found.flashinfer is None and found.deepgemm is None
    assert [n.split(":")[0] for n in found.notes] == ["anchor skipped"] * 2
    cpu = torch.device("cpu")
    for c in bench_topk.build("cpu", cpu, found):
        assert [v.name for v in c.variants] == ["ours", "ours+slots", "torch.topk"]
    assert any("flashinfer did not import" in n for n in bench_topk.SPEC.notes)
    cases = bench_indexer.build("cpu", cpu, found)
    assert not any(v.name == bench_indexer.DEEPGEMM for c in cases for v in c.variants)
    assert any("deep_gemm did not import" in n for n in bench_indexer.SPEC.notes)
    bench_topk.build("cpu", cpu)  # none asked for: said so
    assert any("--anchors flashinfer" in n for n in bench_topk.SPEC.notes)
    monkeypatch.setattr(harness, "import_flashmla", lambda: (None, "no FlashMLA"))
    monkeypatch.setattr(harness, "import_vllm", lambda: (None, "no vLLM"))
    found = harness.repo_anchors(cuda=True)
    assert found.flashinfer is None and found.deepgemm is None and len(found.notes) == 4


def test_topk_checker_allows_other_ties_unless_strict():
    k, n = 64, 300
    chk = bench_topk._Checker(k, exact_rows=2, reference=select_topk_reference)
    s = bench_topk.make_topk_set(3, n, k, device=torch.device("cpu"), workspace=lambda r, d: None)
    s["logits"] = torch.randint(0, 6, (3, n)).float()  # about 50 ties at every k-th score
    s["lengths"][1] = 40  # shorter than k: every position, then -1
    ours = chk.snapshot(select_topk_reference(s["logits"], s["lengths"], k), s)
    assert ours["self"] == ""
    fi = fake_flashinfer([])
    args = (s["logits"], s["offsets"], s["lengths"], k)
    other_ties = fi.top_k_ragged_transform(*args)
    assert not torch.equal(other_ties.sort(dim=1).values, ours["positions"][:, :k].int())
    loose, strict = chk.unordered("positions"), chk.unordered("positions", ties=False)
    assert loose(other_ties, s)["self"] == "" and chk.compare(loose(other_ties, s), ours) == ""
    assert chk.compare(strict(other_ties, s), ours).startswith("mismatch in selected positions")
    low = fi.top_k_ragged_transform(*args, tie_break=1)
    assert chk.compare(strict(low, s), ours) == ""
    slots = fi.top_k_page_table_transform(
        s["logits"], s["block_table"], s["lengths"], k, row_to_batch=s["req_id"],
        page_size=bench_topk.BLOCK_SIZE, out=s["fi_slots"],
    )  # fmt: skip
    assert chk.compare(chk.unordered("slots")(slots, s), ours) == ""
    s["lengths"][1] = n  # top_k has no lengths: compare it on full rows
    full = chk.snapshot(select_topk_reference(s["logits"], s["lengths"], k), s)
    assert chk.compare(chk.unordered("values+indices")(fi.top_k(s["logits"], k), s), full) == ""
    bad = fake_flashinfer([], wrong=True).top_k_ragged_transform(*args)
    assert chk.compare(loose(bad, s), full).startswith("mismatch in selected scores")
    dup = low.clone()
    dup[0, 1] = dup[0, 0]
    assert "duplicated" in loose(dup, s)["self"]
    other_rows = slots.clone()
    other_rows[0] = slots[2]  # another request's slots
    assert chk.unordered("slots")(other_rows, s)["self"]


@cpu_only
def test_smoke_topk_with_a_flashinfer_stand_in(tmp_path, capsys):
    algos: list = []
    anchors = Anchors(flashinfer=fake_flashinfer(algos))
    out = tmp_path / "fi"
    argv = ["--allow-cpu", "--ops", "topk", "--out", str(out), "--seed", "7"]
    assert runner.main([*argv, "--graph-calls", "1"], anchors=anchors) == 0, capsys.readouterr()
    assert bench_topk.FI_ALGO_ENV not in os.environ  # restored after each forced call
    assert {None, "default", "cub"} == set(algos)
    meta, rs, summ = _load(out)
    fi = [r for r in rs if r.variant in FI_NAMES]
    assert {r.variant for r in fi} == FI_NAMES and len(fi) == 2 * len(FI_NAMES)
    assert all(r.check == "ok" and r.role == "baseline" for r in fi)
    assert all(r.check == "ok" for r in rs if r.variant == "torch.topk")
    ours = [r for r in rs if r.variant == "ours"]
    assert all(r.check == "reference" and set(r.speedup_eager) >= FI_NAMES for r in ours)
    slots = {r.variant: r.bytes_moved for r in rs if r.params["N"] == 512}
    assert slots[bench_topk.FI_SLOTS] == slots["ours+slots"] > slots[bench_topk.FLASHINFER]
    (t,) = summ
    row = dict(zip(t.headers, t.rows[0], strict=True))
    assert row["flashinfer us"] != "n/a" and row["vs flashinfer+slots"] != "n/a"
    assert row["fastest baseline"] in FI_NAMES | {"torch.topk"} - {bench_topk.FI_SLOTS}
    assert any("fake timed" in n for n in meta["op_notes"]["topk"])


def fake_deepgemm(*, garbage_inside: bool = False) -> SimpleNamespace:
    """DeepGEMM's paged logits entries with its conventions and checks (2-D context lengths,
    q [B, n, H, D] e4m3, the cache as [pages, 64, 1, D + 4] bytes, logits a view of a
    row-padded buffer, garbage past each row's length); ``garbage_inside``: one visible
    logit of the first request wrong as well."""

    def metadata(context_lens, block_kv, num_sms):
        assert context_lens.dim() == 2 and context_lens.is_contiguous() and block_kv == 64
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def logits(q, kv, weights, context_lens, block_table, sched, max_len, clean_logits):
        b, n, h, d = q.shape
        assert q.dtype == torch.float8_e4m3fn and kv.shape[1:] == (64, 1, d + 4)
        assert sched.shape == (9, 2) and weights.shape == (b * n, h) and not clean_logits
        ref = index_logits_reference(q.view(b * n, h, d), weights, kv, context_lens, block_table)
        out = torch.full((b * n, max_len + 256), 7.0)  # padded rows, garbage where unwritten
        out[:, :max_len] = torch.where(torch.isneginf(ref[:, :max_len]), 7.0, ref[:, :max_len])
        if garbage_inside:
            out[0, 0] += 1.0
        return out[:, :max_len]

    return SimpleNamespace(
        get_paged_mqa_logits_metadata=metadata, fp8_paged_mqa_logits=logits, get_num_sms=lambda: 8
    )


@cpu_only
@pytest.mark.parametrize("garbage_inside", [False, True])
def test_deepgemm_logits_stand_in_is_checked_against_ours(garbage_inside):
    dev = _runtime.default_device()
    anchors = Anchors(deepgemm=fake_deepgemm(garbage_inside=garbage_inside))
    cases = [c for c in bench_indexer.build("cpu", dev, anchors) if c.params["kind"] == "logits"]
    fp8 = [c for c in cases if c.params["dtype"] == "fp8"]
    assert all(bench_indexer.DEEPGEMM not in [v.name for v in c.variants] for c in cases[:2])
    assert {c.params["n"] for c in fp8} == {1, 4}
    backend = timing.select_backend(True)
    cfg = runner.RunConfig(graph_calls=1, reps=1, warmup=0, budget_ms=50.0)
    for case in fp8:
        names = [v.name for v in case.variants]
        if case.params["n"] > 2:  # its sm_90 kernel takes next_n 1 or 2 only
            assert bench_indexer.DEEPGEMM not in names
            continue
        rs, errors = runner.run_case(case, backend, cfg, launch_us=1.0, bw=1e9)
        dg = next(r for r in rs if r.variant == bench_indexer.DEEPGEMM)
        assert dg.role == "baseline" and dg.bytes_moved == rs[0].bytes_moved
        if garbage_inside:
            assert dg.check.startswith("mismatch") and len(errors) == 1
        else:  # the garbage past each row's length is allowed
            assert dg.check == "ok" and not errors, errors
    bench_indexer.POOL.clear()
