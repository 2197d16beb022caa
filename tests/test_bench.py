"""CPU tests of ``sparse-mla bench`` (``sparse_mla.bench``) and the kit's timer and floors
(``sparse_mla.testing.timing``, ``.floor``; the PERF page: ``test_harness.py``). No test
asserts a measured time: timing logic is driven by a fake clock, and the end-to-end runs (the
real kernels in the interpreter, one planted bug each) check that every stage ran and agreed
with its references."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from sparse_mla import _runtime
from sparse_mla.bench import attention as bench_attention
from sparse_mla.bench import cases, record, report, runner
from sparse_mla.bench import indexer as bench_indexer
from sparse_mla.bench import remap as bench_remap
from sparse_mla.bench import topk as bench_topk
from sparse_mla.bench.anchors import Anchors, import_anchors
from sparse_mla.bench.report import Result
from sparse_mla.testing import POISON, floor, timing

ON_GPU = not _runtime.INTERPRETER and torch.cuda.is_available()
cpu_only = pytest.mark.skipif(ON_GPU, reason="the smoke runs use the CPU interpreter backend")


def _load(out):
    """(meta, results, summaries) of a bench record or run directory (its runs merged)."""
    runs = record.load_runs(out)
    meta = dict(runs[0].meta, ops=[op for r in runs for op in r.meta["ops"]])
    return meta, [x for r in runs for x in r.results], [t for r in runs for t in r.summaries]


class FakeBackend(timing.Backend):
    """A fake clock: every counted call "takes" ms_per_call, every timed run adds fixed_ms."""

    name = "fake"

    def __init__(self, ms_per_call: float = 0.002, fixed_ms: float = 0.0) -> None:
        self.device = _runtime.default_device()  # the launch-floor kernel really runs
        self.l2_bytes = 1000
        self.ms_per_call, self.fixed_ms = ms_per_call, fixed_ms
        self.calls = self.captures = 0
        self.log: list[int] = []
        self.fail_capture = False

    def synchronize(self) -> None:
        pass

    def tick(self, i: int = 0) -> None:
        self.calls += 1
        self.log.append(i)

    def time_ms(self, fn, reps):
        def one() -> float:
            before = self.calls
            fn()
            return (self.calls - before) * self.ms_per_call + self.fixed_ms

        return [one() for _ in range(reps)]

    def capture(self, body):
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        body()
        return body


def _counting_calls(fb: FakeBackend, n: int):
    return [functools.partial(fb.tick, i) for i in range(n)]


def test_graph_and_eager_timing():
    fb = FakeBackend(ms_per_call=0.002)
    t = timing.measure_graph(_counting_calls(fb, 3), graph_calls=7, reps=5, warmup=2, backend=fb)
    assert fb.captures == 1 and fb.log[:7] == [0, 1, 2, 0, 1, 2, 0]
    assert fb.calls == 7 * (1 + 2 + 5)  # capture's warm-up + warm-up replays + timed replays
    assert (t.calls, t.reps) == (7, 5) and t.median_us == pytest.approx(2.0)
    fb = FakeBackend(ms_per_call=0.01, fixed_ms=0.04)
    t = timing.measure_eager(_counting_calls(fb, 2), n_calls=4, reps=3, warmup=1, backend=fb)
    assert fb.captures == 0 and fb.calls == 4 * (1 + 3)
    assert t.median_us == pytest.approx((4 * 0.01 + 0.04) * 1e3 / 4)
    s = timing.Timing.from_samples([3.0, 1.0, 2.0, 10.0, 2.5], calls=9)
    assert (s.median_us, s.min_us, s.reps, s.calls) == (2.5, 1.0, 5, 9)
    with pytest.raises(ValueError):
        timing.rotation([], 3)
    fb = FakeBackend(fixed_ms=0.5)
    bw = timing.measure_copy_bandwidth(fb, 4096, reps=3)
    assert bw == pytest.approx(2 * 4096 / 0.5e-3)  # read + written over the median
    g, e = timing.measure_launch_floor(fb, graph_calls=3, reps=2, warmup=1)
    assert fb.captures == 1 and g.calls == 3 and e.calls == 3


def test_graph_us_and_eager_us_are_the_kit_timer_as_numbers():
    fb = FakeBackend(ms_per_call=0.003)
    calls = _counting_calls(fb, 2)
    assert timing.graph_us(calls, reps=4, warmup=1, backend=fb) == pytest.approx(3.0)
    assert fb.captures == 1 and fb.calls == 2 * (1 + 1 + 4)  # one graph of both calls
    fb = FakeBackend(ms_per_call=0.003)
    calls = _counting_calls(fb, 1)
    us = timing.graph_us(calls[0], graph_calls=5, reps=2, warmup=0, backend=fb)
    assert us == pytest.approx(3.0) and fb.calls == 5 * (1 + 2)
    fb = FakeBackend(ms_per_call=0.002, fixed_ms=0.01)
    calls = _counting_calls(fb, 1)
    us = timing.eager_us(calls[0], n_calls=2, reps=3, warmup=1, backend=fb)
    assert us == pytest.approx((2 * 0.002 + 0.01) * 1e3 / 2) and fb.captures == 0
    assert fb.calls == 2 * (1 + 3)


def test_plan_sizes_and_rotation_sets():
    plan = timing.plan_sizes
    assert plan(1.0, max_calls=128, max_reps=30, budget_ms=200) == (128, 30)
    # 1 ms per call: calls drop to the minimum 8 first, then repetitions to fit 200 ms
    assert plan(1000.0, max_calls=128, max_reps=30, budget_ms=200) == (8, 25)
    assert plan(100.0, max_calls=128, max_reps=30, budget_ms=200) == (66, 30)
    assert plan(1e6, max_calls=128, max_reps=30, budget_ms=200) == (8, 5)
    assert plan(1e6, max_calls=2, max_reps=3, budget_ms=1) == (2, 3)
    mb = 1 << 20
    assert timing.rotation_sets(mb, 60 * mb, max_sets=128) == 120  # 2 x L2
    assert timing.rotation_sets(200 * mb, 60 * mb, max_sets=128) == 1
    assert timing.rotation_sets(1000, 60 * mb, max_sets=128) == 128
    assert timing.rotation_sets(mb, 60 * mb, max_sets=128, mem_cap_bytes=10 * mb) == 10
    assert timing.rotation_sets(0, 60 * mb, max_sets=128) == 1


def _toy_case(fb: FakeBackend) -> cases.Case:
    def variant(name, scale, **kw):
        return cases.Variant(name, lambda s: lambda: (fb.tick(), s["x"] * scale)[1], **kw)

    variants = [variant("ours", 2), variant("wrong", 3, role="extra")]
    variants.append(variant("ref", 2, role="baseline", graph_safe=False))
    make_set = lambda i: {"x": torch.arange(4) + 1 + i}  # noqa: E731
    # 400-byte sets, a 1000-byte fake L2: 5 sets
    case = cases.Case("toy", "toy", "toy", "T=4", 4, {}, make_set, 400, variants, lambda s, v: 4000)
    case.snapshot = lambda r, s: r.clone()
    case.compare = lambda a, b: "" if torch.equal(a, b) else "mismatch"
    case.reference = "ref"
    return case


def test_run_case_checks_rotation_budget_and_capture_failures():
    fb = FakeBackend(ms_per_call=0.001)
    cfg = runner.RunConfig(graph_calls=8, reps=3, warmup=1, budget_ms=100)
    rs, errors = runner.run_case(_toy_case(fb), fb, cfg, launch_us=0.5, bw=1e9)
    by = {r.variant: r for r in rs}
    assert [by[v].check for v in ("ours", "wrong", "ref")] == ["ok", "mismatch", "reference"]
    assert errors == ["toy T=4 wrong: mismatch vs ref"]
    r = by["ours"]
    assert (r.n_sets, r.working_set_bytes, r.l2_bytes) == (5, 2000, 1000)
    assert r.graph_us == pytest.approx(1.0) and (r.graph_calls, r.graph_reps) == (8, 3)
    assert r.eager_us == pytest.approx(1.0) and r.eager_calls == 8
    assert r.floor_us == pytest.approx(4.0)  # max(0.5 us, 4000 B / 1 GB/s)

    fb.fail_capture = True
    rs, errors = runner.run_case(_toy_case(fb), fb, cfg, launch_us=0.5, bw=1e9)
    assert all(r.graph_us is None and r.eager_us is not None for r in rs)
    assert rs[2].note.startswith("graph capture failed: RuntimeError")
    # our kernels must be graph-safe: their failed capture is an error, the baseline's a note
    assert sum("graph capture failed" in e for e in errors) == 2
    assert not any(e.startswith("toy T=4 ref") for e in errors)

    fb = FakeBackend(ms_per_call=0.001)
    cfg = runner.RunConfig(graph_calls=64, reps=30, warmup=0, budget_ms=100)
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


def test_floor_and_byte_counts():
    bw = 4.3e12
    assert floor.floor_us(0.6, 0, bw) == 0.6  # launch-bound
    assert floor.floor_us(0.6, 4.3e6, bw) == pytest.approx(1.0)  # bandwidth-bound: max
    assert report.gbs(2e9, 1e6) == pytest.approx(2.0)
    assert floor.copy_fraction(10**9, 1e6, 4e9) == pytest.approx(0.25)
    # T=2, K=4, 3 pages: 2*4*4 read + 2*4*4 written + 2*4 req + 3*4 pages + 2*4 counts
    assert floor.remap_bytes(2, 4, 3) == 32 + 32 + 8 + 12 + 8
    # B=2, W=8, T=5: rows read 64 + lens read 16 + rows written 160 + 3 per-token outputs 60
    assert floor.expand_bytes(2, 8, 5, per_token_outputs=3) == 64 + 16 + 160 + 60
    # 2 rows of 8 scores, k=4: logits 64 + lengths 8 + positions 32; fused: + counts 8
    # + req_id 8 + 3 block-table entries 12
    assert floor.topk_bytes(2, 8, 4) == 64 + 8 + 32
    assert floor.topk_bytes(2, 8, 4, fused_pages=3) == 104 + 28
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
    assert [floor.kfmt(v) for v in (512, 1536, 4096, 131072)] == ["512", "1536", "4K", "128K"]
    # attention: T*topk gathered rows; 2 FLOPs per MAC over 576 (scores) + 512 (output) dims
    assert floor.attention_bytes(2, 128, "fp8") == 2 * 128 * 656
    assert floor.attention_bytes(2, 128, "bf16") == 2 * 128 * 1152
    assert floor.attention_flops(16, 2, 128) == 2 * 16 * 2 * 128 * 1088
    assert floor.floor_us(0.6, 4.3e6, bw, flops=int(1.58e9)) == pytest.approx(2.0)  # compute
    assert floor.floor_us(0.6, 4.3e6, bw, flops=790) == pytest.approx(1.0)
    req_id = torch.tensor([0, 0, 1], dtype=torch.int32)
    idx = torch.tensor([[0, 63, 64, -1], [65, 200, -1, -1], [0, 5000, 64, 70]], dtype=torch.int32)
    # request 0: pages {0, 1, 3}; request 1: {0, 1} (page 78 is outside the 4-page table)
    assert floor.count_touched_pages(req_id, idx, block_size=64, max_blocks=4) == 5
    # rank 0 of 2 owns even positions, local p // 2: req 0 -> {0, 1}; req 1 -> {0}
    dcp = dict(dcp_size=2, dcp_rank=0, interleave=1)
    assert floor.count_touched_pages(req_id, idx, block_size=64, max_blocks=4, **dcp) == 3


def test_remap_inputs_and_baselines_from_the_caller():
    cpu = torch.device("cpu")
    s = bench_remap.make_remap_set(5, 16, width=8, ctx=4096, max_requests=2, device=cpu)
    idx = s["token_indices"]
    assert idx.shape == (5, 16) and s["req_id"].tolist() == [0, 0, 0, 1, 1]
    assert (idx != 0).any() and (s["block_table"] != 0).any()
    assert all(r[r >= 0].numel() == int((r >= 0).sum()) for r in idx)  # -1 only as a suffix
    # the upstream tilings are the caller's (the repository's harness passes them)
    ops = bench_remap._ops(Anchors(remap_layouts={"up": len}))
    assert ops.baselines == {"up": len} and bench_remap._ops(Anchors()).baselines == {}


_BASE = dict(op="remap", group="remap K=2048", plot="remap_K2048", bytes_moved=10**6)
_BASE.update(floor_us=0.6, launch_us=0.6, copy_gbs=4300.0, n_sets=4, working_set_bytes=10)
_BASE.update(l2_bytes=100, graph_calls=128, graph_reps=30, check="ok")


def _r(case: str, x: int, variant: str, role: str, g: float | None, e: float, **kw) -> Result:
    d = dict(_BASE, case=case, variant=variant, role=role, series=variant, x=x, graph_us=g)
    return Result(**dict(d, params={"K": 2048, "tokens": x}, eager_us=e, **kw))


def _sample_results() -> list[Result]:
    rs = []
    times = [(1, 2.0, 3.0, 2.0), (256, 2.2, 5.65, 2.5), (1024, 3.84, 12.22, 4.0)]
    for x, ours, tiled, seed in times:
        rs += [
            _r(f"T={x}", x, "ours", "ours", ours, 10.0),
            _r(f"T={x}", x, "tiled_atomic", "baseline", tiled, 20.0),
            _r(f"T={x}", x, "seed", "baseline", seed, 15.0),
            _r(f"T={x}", x, "torch", "baseline", None, 80.0, note="graph capture failed: x"),
        ]
    report.finalize(rs)
    return rs


def test_finalize_per_step_and_group_tables():
    rs = _sample_results()
    ours, torch_r = rs[0], rs[3]
    assert ours.speedup_graph == {"tiled_atomic": pytest.approx(1.5), "seed": 1.0}
    assert ours.speedup_eager["torch"] == pytest.approx(8.0)
    assert ours.over_floor == pytest.approx(2.0 / 0.6)
    assert ours.achieved_gbs == pytest.approx(1e6 / 2e-6 / 1e9)
    assert torch_r.best_us == 80.0 and torch_r.speedup_graph == {}
    kw = dict(group="remap K=2048", ours="ours")
    t = report.per_step_table(rs, **kw, baselines=("tiled_atomic", "seed"), tokens=(1, 256, 9999))
    rows = {(r[0], r[1]): r for r in t.rows}
    assert len(rows) == 4  # 9999 is absent
    assert rows[("256", "tiled_atomic")][5:] == ["3.45", "210", "269"]
    assert rows[("256", "tiled_atomic")][4] == "2.57x"
    assert rows[("1", "seed")][5:] == ["0.00", "0", "0"]
    # torch has no graph time: both sides fall back to eager times (10 vs 80 us)
    t = report.per_step_table(rs, **kw, baselines=("torch",), tokens=(1,))
    assert t.rows == [["1", "torch (eager)", "80.0", "10.0", "8.00x", "70.00", "4270", "5460"]]
    (g,) = report.group_tables(rs, "graph")
    (e,) = report.group_tables(rs, "eager")
    assert g.headers[:4] == ["case", "sets", "bytes", "floor us"]
    assert g.rows[0][0] == "T=1" and "n/a" in g.rows[0]  # torch has no graph time
    assert g.rows[0][g.headers.index("vs tiled_atomic")] == "1.50x"
    assert e.rows[0][e.headers.index("vs torch")] == "8.00x"
    text = report.render_text(g)
    assert text.startswith("== remap K=2048 (graph)") and "ours/floor" in text
    md = report.render_markdown_table(g)
    assert md.splitlines()[0].startswith("| case | sets |") and md.count("\n| T=") == 3


def test_gpu_grids_build_lazily_and_cache_pool():
    # Building the GPU grids allocates nothing (inputs and caches are made per case, later).
    cpu = torch.device("cpu")
    full = bench_topk.build("full", cpu)
    assert len(full) == 12 and {c.params["k"] for c in full} == {2048}
    assert len(bench_topk.build("quick", cpu)) == 4
    cases_ = bench_indexer.build("full", cpu)
    logits = [c for c in cases_ if c.params["kind"] == "logits"]
    layer = [c for c in cases_ if c.params["kind"] == "layer"]
    assert len(logits) == 4 and len(layer) == 27
    assert {(c.params["B"], c.params["ctx"]) for c in logits} == {(64, 32768)}
    assert all(c.budget_ms == 100.0 and c.params["dtype"] == "fp8" for c in layer)
    assert {len(c.variants) for c in layer if c.params["n"] == 1} == {5}  # no expansion
    big = max(layer, key=lambda c: c.set_bytes)  # far beyond L2: one set, no rotation
    assert (big.params["B"], big.params["ctx"], big.params["n"]) == (128, 131072, 4)
    assert timing.rotation_sets(big.set_bytes, 60 << 20, max_sets=128) == 1
    assert len(bench_indexer.build("quick", cpu)) == 4 + 4
    assert bench_indexer.POOL._caches == {}
    # bf16: 64 requests x 512 pages; fp8: the largest layer case, 128 x 2048 pages
    grid = bench_indexer.GRIDS["full"]
    assert bench_indexer.pages_needed(grid) == {False: 64 * 512, True: 128 * 2048}
    pool, dev = bench_indexer.CachePool(), _runtime.default_device()  # the writers really run
    c = pool.get(fp8=True, pages=3, page=64, dim=32, device=dev)
    assert c.shape[0] == 3 and c.dtype == torch.uint8 and bool((c != 0).any())
    assert pool.get(fp8=True, pages=2, page=64, dim=32, device=dev) is c and pool.builds == 1
    c5 = pool.get(fp8=True, pages=5, page=64, dim=32, device=dev)
    assert c5.shape[0] == 5 and pool.builds == 2  # grown when a case needs more pages
    b = pool.get(fp8=False, pages=2, page=64, dim=32, device=dev)
    assert b.dtype == torch.bfloat16 and pool.builds == 3
    pool.clear()
    assert pool.get(fp8=False, pages=1, page=64, dim=32, device=dev) is not b
    # attention: 2 formats x h_q {16, 128} x T {1, 8, 128}; no anchors without CUDA
    full = bench_attention.build("full", cpu)
    assert len(full) == 12 and len(bench_attention.build("quick", cpu)) == 8
    assert {(c.params["topk"], c.params["cache_tokens"]) for c in full} == {(2048, 1 << 20)}
    assert all([v.name for v in c.variants] == ["ours", "ours fused"] for c in full)
    big = next(c for c in full if (c.params["cache"], c.params["h_q"], c.x) == ("bf16", 128, 128))
    assert big.flops == 2 * 128 * 128 * 2048 * 1088 and big.set_bytes > 128 * 2048 * 1152
    assert bench_attention.POOL._caches == {}
    assert "anchors: none asked for" in bench_attention.SPEC.notes[-1]
    fm, vl = _fake_anchors()  # anchors passed by the caller join the cases of their format
    named = bench_attention.build("quick", cpu, Anchors(flashmla=fm, vllm=vl))
    names = {(c.params["cache"], v.name) for c in named for v in c.variants if v.role == "baseline"}
    assert names == {("fp8", "FlashMLA"), ("bf16", "vLLM Triton")}


def test_topk_checker_catches_wrong_selections():
    from sparse_mla.ops.topk.naive import positions_to_slots_reference, select_topk_reference

    k, n = 128, 300
    chk = bench_topk._Checker(k, exact_rows=2, reference=select_topk_reference)
    s = bench_topk.make_topk_set(3, n, k, device=torch.device("cpu"), workspace=lambda r, d: None)
    pos = select_topk_reference(s["logits"], s["lengths"], k)
    ref = chk.snapshot(torch.topk(s["logits"], k, dim=1), s)
    assert ref["self"] == ""
    slots, counts = positions_to_slots_reference(pos, s["block_table"], s["req_id"], block_size=64)
    for ret in (pos.clone(), torch.topk(s["logits"], k, dim=1, sorted=False), (slots, counts)):
        snap = chk.snapshot(ret, s)
        assert snap["self"] == "" and chk.compare(snap, ref) == ""

    def bad(row: int, col: int, value: int | None = None) -> torch.Tensor:
        x = pos.clone()
        x[row, col] = sorted(set(range(n)) - set(pos[row].tolist()))[0] if value is None else value
        return x

    # past the exactly-checked rows: the score comparison catches it
    snap = chk.snapshot(bad(2, 0), s)
    assert snap["self"] == "" and chk.compare(snap, ref).startswith("mismatch in selected scores")
    assert "select_topk_reference" in chk.snapshot(bad(0, 3), s)["self"]
    assert "unwritten" in chk.snapshot(bad(2, 5, POISON), s)["self"]
    assert "duplicated" in chk.snapshot(bad(2, 1, int(pos[2, 0])), s)["self"]
    other = slots.clone()
    other[0, 0] = slots[1, 0]  # another request's slot
    assert chk.snapshot((other, counts), s)["self"]
    assert "valid counts" in chk.snapshot((slots, counts - 1), s)["self"]


def _fake_anchors():
    """Stand-ins for FlashMLA and vLLM's kernel with their calling conventions and output
    shapes (FlashMLA: 64 or 128 heads, lse [1, h, T] with +inf for empty rows; vLLM: out only),
    computed by the reference."""
    from sparse_mla.ops.attention import sparse_mla_decode_reference as ref

    def flash(q, k, block_table, seqlens, dv, sched, *, softmax_scale, is_fp8_kvcache, indices):
        assert q.shape[2] in (64, 128) and k.dtype == torch.float8_e4m3fn and is_fp8_kvcache
        assert block_table is None and dv == 512 and sched == "sched"
        kw = dict(sm_scale=softmax_scale, dtype=torch.float32)
        out, lse = ref(q[0], k.view(torch.uint8), indices[0], **kw)
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        return out.bfloat16()[None], lse.t()[None]

    def vllm(q, kv, indices, sm_scale):
        assert kv.shape[1:] == (1, 576) and indices.shape[1] == 1
        return ref(q, kv, indices[:, 0], sm_scale=sm_scale, dtype=torch.float32)[0].bfloat16()

    fm = SimpleNamespace(get_mla_metadata=lambda: ("sched", None), flash_mla_with_kvcache=flash)
    return fm, SimpleNamespace(triton_sparse_mla_attention=vllm)


def test_attention_checker_and_anchor_launches():
    from sparse_mla.ops.attention import sparse_mla_decode, sparse_mla_decode_reference

    dev = _runtime.default_device()  # the cache writer and our kernel really run
    fill = bench_attention._filled_mla_cache
    caches = {f: fill(4, 64, 576, fp8=f == "fp8", device=dev) for f in ("fp8", "bf16")}
    fm, vl = _fake_anchors()
    for fmt, cache in caches.items():
        s = bench_attention.make_attention_set(
            cache, tokens=3, heads=16, topk=64, invalid_tail=8, workspace=None
        )
        pos, slots, bt = s["positions"], s["slots"], s["block_table"]
        assert ((pos == -1) == (slots == -1)).all() and (slots[:, -8:] == -1).all()
        assert (slots[:, :-8] >= 0).all() and int(slots.max()) < 4 * 64
        want = torch.arange(4, dtype=torch.int32, device=bt.device).expand(3, 4)
        assert torch.equal(bt.sort(dim=1).values, want)
        chk = bench_attention._Checker(sparse_mla_decode_reference, rows=2)
        kw = dict(sm_scale=bench_attention.SM_SCALE)
        ours = sparse_mla_decode(s["q"], cache, slots, **kw)
        ref = chk.snapshot(ours, s)
        assert ref["self"] == "" and ref["exact"]
        fused = sparse_mla_decode(s["q"], cache, pos, block_table=bt, req_id=s["req_id"], **kw)
        assert chk.compare(chk.snapshot(fused, s), ref) == ""
        # one ulp off in a row past the checked ones: within tolerance, but not bit-equal
        off = (ours[0].clone(), ours[1].clone())
        off[0].view(torch.int16)[2, 0, 0] += 1  # the next bf16 value
        snap = chk.snapshot(off, s)
        assert snap["self"] == "" and chk.compare(snap, ref).startswith("mismatch: out not bit")
        bad = (ours[0].clone(), ours[1].clone())
        bad[0][1, 3] += 1.0
        assert chk.snapshot(bad, s)["self"].startswith("out: max err")
        bad = (ours[0].clone(), ours[1].clone())
        bad[1][0, 5] += 0.01
        assert chk.snapshot(bad, s)["self"].startswith("lse: max err")
        bad = (ours[0].clone(), ours[1].clone())
        bad[0][0, :, :7] = float("nan")  # poison left
        assert "NaN in out" in chk.snapshot(bad, s)["self"]
        if fmt == "fp8":  # h_q 16: padded to 64 heads, q copied in on every call
            launch, q4 = bench_attention.flashmla_launch(fm, s["q"], cache, kw["sm_scale"])
            ret = launch(slots)
            assert q4.shape == (1, 3, 64, 576) and torch.equal(q4[0, :, :16], s["q"])
            assert ret[0].shape == (1, 3, 64, 512) and ret[1].shape == (1, 64, 3)
            snap = chk.snapshot(ret, s)
            assert snap["self"] == "" and not snap["exact"] and chk.compare(snap, ref) == ""
            s["q"].mul_(2)
            launch(slots)
            assert torch.equal(q4[0, :, :16], s["q"]) and not q4[0, :, 16:].any()
        else:  # vLLM returns out only: out alone is checked
            out = bench_attention.vllm_launch(vl, s["q"], cache, kw["sm_scale"])(slots)
            assert chk.snapshot(out, s)["self"] == ""
            out[0, 0] += 1.0
            assert chk.snapshot(out, s)["self"].startswith("out: max err")
    # 128 heads: FlashMLA takes q as it is (no copy), and an empty row's +inf lse maps to -inf
    q = torch.randn(2, 128, 576, device=dev).bfloat16()
    ix = torch.full((2, 64), -1, dtype=torch.int32, device=dev)
    ix[1, :5] = torch.arange(5)
    launch, q4 = bench_attention.flashmla_launch(fm, q, caches["fp8"], 0.1)
    assert q4.data_ptr() == q.data_ptr()
    out, lse = bench_attention.flashmla_outputs(*launch(ix), 128)
    assert out.shape == (2, 128, 512) and torch.isneginf(lse[0]).all() and lse[1].isfinite().all()


def test_layer_check_helpers():
    slots = torch.tensor([[5, 7, -1], [1, -1, -1]], dtype=torch.int32)
    counts = torch.tensor([2, 1], dtype=torch.int32)
    snap, check = bench_indexer._layer_snapshot, bench_indexer._layer_self_check
    compare = cases.compare_exact  # the layer's, remap's and the expansion's comparison
    a = snap((slots, counts))
    assert check(a) == "" and compare(a, a) == ""
    other = snap(torch.zeros(2, 3))  # e.g. the logits stage
    assert other == {} and check(other) == "" and compare(other, a) == "skipped"
    assert compare(snap((slots.flip(1).contiguous(), counts)), a).startswith("mismatch in slots")
    c = snap((slots, counts + 1))
    assert "counts" in check(c) and compare(c, a).startswith("mismatch in valid counts (2 of 2")
    p = slots.clone()
    p[1, 2] = POISON
    assert "unwritten" in check(snap((p, counts)))
    assert compare({"x": slots[:1]}, {"x": slots}).startswith("mismatch: x shape (1, 3)")
    s = {"out": torch.ones(2), "counts": torch.ones(2)}
    cases.poison_keys("out")(s)
    assert (s["out"] == POISON).all() and (s["counts"] == 1).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_logits_checker_against_fp64(fp8):
    ops, dev = bench_indexer._ops(), _runtime.default_device()  # the writers really run
    cache = bench_indexer.CachePool().get(fp8=fp8, pages=9, page=64, dim=32, device=dev)
    # ctx 200 is not a page multiple: columns 200..255 must be -inf
    s = bench_indexer.make_indexer_set(
        ops, cache, requests=2, n=2, ctx=200, heads=8, dim=32, page=64, fp8=fp8, device=dev
    )
    chk = bench_indexer._LogitsChecker(ops.reference, 2, heads=8, dim=32, fp8=fp8, device=dev)
    args = (s["q"], s["weights"], s["cache"])
    native = chk.snapshot(ops.logits(*args, s["seq_lens"], s["block_table"], next_n=2), s)
    f = s["exp"]
    flat = chk.snapshot(ops.logits(*args, f.seq_lens, f.block_table, next_n=1), s)
    assert native["self"] == flat["self"] == "" and chk.compare(flat, native) == ""
    x = native["logits"].clone()
    x[3, 10] += 1.0  # request 1, row 1
    assert "err/tol" in chk.vs_reference(x, s)
    assert chk.compare({"logits": x}, native).startswith("mismatch in logits")
    x = native["logits"].clone()
    x[0, 250] = 0.0  # a column no row can see
    assert "-inf pattern" in chk.vs_reference(x, s)
    assert chk.compare({"logits": x}, native) == "mismatch in the -inf pattern"
    x = native["logits"].clone()
    x[2, :5] = POISON
    assert chk.vs_reference(x, s)


def _ir(variant: str, us: float, nbytes: int = 10**6, op: str = "indexer", **params) -> Result:
    d = dict(op=op, group="g", plot="p", case="c", variant=variant, role="ours", series=variant)
    d.update(x=1, params=params, bytes_moved=nbytes, launch_us=0.5, copy_gbs=4000.0)
    return Result(**d, floor_us=us / 2, graph_us=us, eager_us=us * 2)


def test_indexer_and_topk_summaries():
    lay = dict(kind="layer", dtype="fp8", ctx=8192, k=2048)
    stages = [("chain", 10.0), ("expand", 1.0), ("logits", 5.0), ("top-k", 3.0), ("remap", 1.5)]
    rs = [_ir(v, t, B=2, n=2, **lay) for v, t in [*stages, ("top-k+slots", 3.5)]]
    one = [("chain", 6.0), ("logits", 4.0), ("top-k", 2.0), ("remap", 1.0)]
    rs += [_ir(v, t, B=1, n=1, **lay) for v, t in one]
    shape = dict(kind="logits", dtype="bf16", B=64, ctx=32768, n=4)
    rs += [_ir("native", 100.0, 4 * 10**8, **shape), _ir("flattened", 300.0, 4 * 10**8, **shape)]
    report.finalize(rs)
    logits_t, layer_t = bench_indexer.summaries(rs)
    h = logits_t.headers
    native, flat = logits_t.rows
    assert native[h.index("% copy")] == "100%" and native[h.index("GB/s")] == "4000"
    assert native[h.index("native speedup")] == ""
    assert flat[h.index("% copy")] == "33%" and flat[h.index("native speedup")] == "3.00x"
    h = layer_t.headers
    one, two = layer_t.rows  # sorted by (ctx, B, n)
    assert one[h.index("expand us")] == "-" and one[h.index("sum us")] == "7.00"
    assert two[h.index("sum us")] == "10.5" and two[h.index("fused sum us")] == "9.50"
    assert two[h.index("chain us")] == "10.0" and two[h.index("chain/floor")] == "2.00x"
    assert two[h.index("sum x61 ms")] == f"{10.5 * 61 / 1e3:.2f}"
    assert one[h.index("top-k+slots us")] == "n/a" and one[h.index("fused sum us")] == "n/a"

    variants = [("ours", 8.0), ("ours+slots", 12.0), ("torch.topk", 30.0)]
    rs = [_ir(v, us, op="topk", N=4096, B=8) for v, us in variants]
    report.finalize(rs)
    (t,) = bench_topk.summaries(rs)
    row = dict(zip(t.headers, t.rows[0], strict=True))
    assert row["N"] == "4K" and row["slots/ours"] == "1.50x" and row["vs torch.topk"] == "3.75x"
    assert row["ours % copy"] == "3%"  # 1 MB in 8 us = 125 GB/s of 4000


def _planted(module, name: str, when, monkeypatch) -> None:
    """Wrap ``module._ops().<name>``: one output entry off by one where ``when(args, kw)``."""
    real = module._ops

    def ops(*a):
        o = real(*a)
        fn = getattr(o, name)

        def wrapped(*args, **kw):
            ret = fn(*args, **kw)
            if when(args, kw):
                (ret[0] if isinstance(ret, tuple) else ret)[-1, 0] += 1
            return ret

        return SimpleNamespace(**dict(vars(o), **{name: wrapped}))

    monkeypatch.setattr(module, "_ops", ops)


@cpu_only
def test_cli_usage_errors(capsys):
    assert runner.resolve_ops("all") == ["remap", "expand", "topk", "indexer", "attention"]
    assert runner.resolve_ops("topk, indexer,topk") == ["topk", "indexer"]
    assert runner.parse_args([]).ops == "remap,expand"  # the default set is unchanged
    assert all(runner.load_op(name).name == name for name in runner.OP_MODULES)
    assert runner.main([]) == 2
    assert "--allow-cpu" in capsys.readouterr().err
    assert runner.main(["--allow-cpu", "--ops", "remap,nope"]) == 2
    assert "unknown op" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.parse_args(["--anchors", "flashmla,nope"])
    assert "unknown anchor" in capsys.readouterr().err
    # named anchors are imported by module name; one that does not import is a note
    missing = import_anchors(["flashmla", "vllm"])
    assert missing.flashmla is None and len(missing.notes) == 2


@cpu_only
def test_smoke_topk_indexer(tmp_path, capsys, monkeypatch):
    # a planted bug in the fused top-k epilogue at N=2048 only
    when = lambda args, kw: "block_table" in kw and args[0].shape[1] == 2048  # noqa: E731
    _planted(bench_topk, "select", when, monkeypatch)
    out = tmp_path / "ti"
    argv = ["--allow-cpu", "--ops", "topk,indexer", "--out", str(out), "--seed", "13"]
    assert runner.main([*argv, "--graph-calls", "1"]) == 1, capsys.readouterr().err
    meta, rs, summ = _load(out)
    assert meta["ops"] == ["topk", "indexer"] and meta["mode"] == "cpu"  # as asked for
    bad = {(r.group, r.variant) for r in rs if r.check.startswith("mismatch")}
    assert bad == {("topk N=2K k=128", "ours+slots")}
    others = [r for r in rs if (r.group, r.variant) not in bad]
    assert all(r.check in ("ok", "reference", "skipped") and not r.note for r in others)
    # only the layer stages whose outputs are not slots have nothing to compare with
    assert {r.variant for r in rs if r.check == "skipped"} == {"expand", "logits", "top-k"}
    top = [r for r in rs if r.op == "topk"]
    assert {r.variant for r in top} == {"ours", "ours+slots", "torch.topk"}
    assert {r.params["N"] for r in top} == {512, 2048}  # 2048 with num_splits=2: split path
    logits = [r for r in rs if r.params.get("kind") == "logits"]
    per_dtype = [(1, "native"), (4, "native"), (4, "flattened")]
    want = {(d, n, v) for d in ("bf16", "fp8") for n, v in per_dtype}
    assert {(r.params["dtype"], r.params["n"], r.variant) for r in logits} == want
    layer = [r for r in rs if r.params.get("kind") == "layer"]
    names = ("chain", *bench_indexer.LAYER_STAGES, "top-k+slots")
    want = {(n, v) for n in (1, 2) for v in names if n > 1 or v != "expand"}
    assert {(r.params["n"], r.variant) for r in layer} == want
    assert all(r.graph_us and r.eager_us and r.floor_us > 0 and r.bytes_moved > 0 for r in rs)
    chain = next(r for r in layer if r.variant == "chain" and r.params["n"] == 2)
    stages = [r for r in layer if r.params["n"] == 2 and r.variant in bench_indexer.LAYER_STAGES]
    assert chain.bytes_moved == sum(r.bytes_moved for r in stages)
    titles = [t.title for t in summ]
    assert titles[1].startswith("indexer logits") and titles[2].startswith("indexer side per layer")
    assert titles[0].startswith("top-k: ours vs torch.topk") and len(summ[2].rows) == 2
    text = (out / "table.txt").read_text()
    assert "indexer side per layer" in text and "% copy" in text
    assert any("fp64" in n for n in meta["op_notes"]["indexer"])
    assert bench_indexer.POOL._caches == {}  # the shared caches are freed after the run


@cpu_only
def test_smoke_attention(tmp_path, capsys, monkeypatch):
    # stand-in anchors, and a planted bug in the fused call on the fp8 cache only
    fm, vl = _fake_anchors()
    anchors = Anchors(flashmla=fm, vllm=vl, notes=["stand-in anchors"])
    when = lambda args, kw: "block_table" in kw and args[1].dtype == torch.uint8  # noqa: E731
    _planted(bench_attention, "decode", when, monkeypatch)
    out = tmp_path / "att"
    argv = ["--allow-cpu", "--ops", "attention", "--out", str(out), "--seed", "7"]
    argv += ["--graph-calls", "1"]
    assert runner.main(argv, anchors=anchors) == 1, capsys.readouterr().err
    meta, rs, summ = _load(out)
    assert meta["ops"] == ["attention"] and "stand-in anchors" in meta["op_notes"]["attention"]
    bad = {(r.group, r.variant) for r in rs if r.check.startswith("mismatch")}
    assert bad == {("attention fp8 h_q=16", "ours fused")}
    others = [r for r in rs if (r.group, r.variant) not in bad]
    assert all(r.check in ("ok", "reference") and not r.note for r in others)
    want = {("fp8", v) for v in ("ours", "ours fused", "FlashMLA")}
    want |= {("bf16", v) for v in ("ours", "ours fused", "vLLM Triton")}
    assert {(r.params["cache"], r.variant) for r in rs} == want
    for r in rs:
        assert r.graph_us and r.eager_us and r.flops == 2 * 16 * 2 * 128 * 1088
        assert r.bytes_moved == 2 * 128 * floor.MLA_ROW_BYTES[r.params["cache"]]
        assert r.floor_us >= r.flops / floor.PEAK_FLOPS * 1e6
    ours = next(r for r in rs if r.variant == "ours" and r.params["cache"] == "fp8")
    assert set(ours.speedup_graph) == {"FlashMLA"}  # the anchor is the case's baseline
    (t,) = summ
    assert t.title.startswith("attention: ours") and len(t.rows) == 2
    assert bench_attention.summaries(_sample_results()) == []  # other ops' results: no table
    assert bench_attention.summaries([*_sample_results(), *rs]) == summ
    row = dict(zip(t.headers, t.rows[0], strict=True))
    assert row["cache"] == "fp8" and row["anchor"] == "FlashMLA" and row["anchor/ours"] != "n/a"
    assert row["ours TFLOPS"] != "n/a"
    text = (out / "table.txt").read_text()
    assert "== attention: ours" in text and "anchor/ours" in text
    assert any("790 TFLOPS" in n for n in meta["op_notes"]["attention"])
    assert bench_attention.POOL._caches == {}


def test_host_cost_table_with_stubbed_launches():
    # The wrappers' own cost (kernels stubbed out): every public call is timed and counted.
    from sparse_mla.bench import host

    dev = torch.device("cuda" if ON_GPU else "cpu")
    res = host.measure_host_costs(dev, calls=2, stub=True, topk_cols=4096)
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
    assert seen["out"] == tmp_path and seen["fast"] is ON_GPU  # the cached launch: GPU only
    if not ON_GPU:
        assert runner.main(["--ops", "host"]) == 2  # no GPU, no --allow-cpu
