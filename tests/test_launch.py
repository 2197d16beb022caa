"""Host-cost machinery: plans cached per metadata key, and the cached Triton launch."""

from __future__ import annotations

import pytest
import torch

import sparse_mla
from sparse_mla import _launch
from sparse_mla.ops.remap import api as remap_api
from sparse_mla.ops.remap.naive import convert_req_index_to_global_index_reference as remap_ref
from sparse_mla.ops.topk import api as topk_api
from sparse_mla.ops.topk.naive import select_topk_reference
from sparse_mla.testing import POISON

DEV = sparse_mla._runtime.default_device()


def remap_inputs(t: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    bt = torch.randint(-1, 1000, (3, 8), generator=g, dtype=torch.int32).to(DEV)
    req = torch.randint(-1, 4, (t,), generator=g, dtype=torch.int32).to(DEV)
    ti = torch.randint(-2, 8 * 16 + 4, (t, k), generator=g, dtype=torch.int32).to(DEV)
    return req, bt, ti


def test_keys_tell_apart_what_the_checks_read():
    t = torch.zeros(4, 6, dtype=torch.int32)
    meta = _launch.tensor_meta
    assert meta(t) == meta(torch.ones(4, 6, dtype=torch.int32))
    assert meta(t) != meta(t.t().contiguous().t())  # strides
    assert meta(t) != meta(t.float())  # dtype
    assert meta(t) != meta(t[:3])  # shape
    assert meta(t.float()) != meta(torch.nn.Parameter(t.float(), requires_grad=False))  # class
    assert meta(None) is None
    with pytest.raises(AttributeError):
        meta([1, 2])
    # True == 1 and 64.0 == 64 as dict keys, but not here.
    assert _launch.scalars_key(1, 64) != _launch.scalars_key(True, 64.0)
    assert _launch.scalars_key(1, None) == _launch.scalars_key(1, None)
    lay = sparse_mla.RemapLayout(1, 128, 1, 1, False, True, 4, pdl=1)
    bad = sparse_mla.RemapLayout(1, 128, 1, 1, False, True, 4, pdl=True)
    assert lay == bad and _launch.value_key(lay) != _launch.value_key(bad)


def test_plan_cache_is_bounded_and_skips_unhashable():
    c = _launch.HostPlanCache(maxsize=2)
    for i in range(5):
        c.put(i, i)
    assert len(c) <= 2 and c.get(4) == 4
    assert c.put([1], "x") == "x" and c.get([1]) is None and c.get(None) is None


def test_remap_cached_plans_match_uncached_and_reference(seed):
    remap_api._PLANS.clear()
    for i in range(3):  # the same metadata: one plan, fresh data every call
        req, bt, ti = remap_inputs(5, 40, seed + i)
        out = torch.full((5, 40), POISON, dtype=torch.int32, device=DEV)
        got = sparse_mla.convert_req_index_to_global_index(req, bt, ti, block_size=16, out=out)
        assert torch.equal(got, remap_ref(req, bt, ti, block_size=16))
    assert len(remap_api._PLANS) == 1
    # Another stride of the same shape is another plan (the kernel gets the strides).
    req, bt, ti = remap_inputs(5, 40, seed)
    ti_t = ti.t().contiguous().t()
    out = torch.full((5, 40), POISON, dtype=torch.int32, device=DEV)
    got = sparse_mla.convert_req_index_to_global_index(req, bt, ti_t, block_size=16, out=out)
    assert len(remap_api._PLANS) == 2
    assert torch.equal(got, remap_ref(req, bt, ti, block_size=16))
    # Compact DCP with counts, cached and uncached.
    args = dict(dcp_size=2, dcp_rank=1, block_size=16, return_valid_counts=True)
    first = sparse_mla.filter_and_convert_dcp_index(req, bt, ti, **args)
    again = sparse_mla.filter_and_convert_dcp_index(req, bt, ti, **args)
    remap_api._PLANS.clear()
    fresh = sparse_mla.filter_and_convert_dcp_index(req, bt, ti, **args)
    for a, b in ((first, fresh), (again, fresh)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_remap_checks_still_run_on_a_cache_hit(seed):
    req, bt, ti = remap_inputs(4, 32, seed)
    out = torch.empty(4, 32, dtype=torch.int32, device=DEV)
    sparse_mla.convert_req_index_to_global_index(req, bt, ti, block_size=16, out=out)
    # Same metadata, but the output aliases the input: the address check is not cached.
    both = torch.empty(2, 4, 32, dtype=torch.int32, device=DEV)
    sparse_mla.convert_req_index_to_global_index(req, bt, both[0], block_size=16, out=both[1])
    with pytest.raises(ValueError, match="overlaps token_indices"):
        sparse_mla.convert_req_index_to_global_index(req, bt, both[0], block_size=16, out=both[0])
    with pytest.raises(TypeError, match="block_size"):
        sparse_mla.convert_req_index_to_global_index(req, bt, ti, block_size=True, out=out)
    with pytest.raises(TypeError):
        sparse_mla.convert_req_index_to_global_index(req, bt, ti.tolist(), block_size=16)
    counts = torch.empty(4, dtype=torch.int32, device=DEV)
    kw = dict(block_size=16, return_valid_counts=True, out=out)
    sparse_mla.convert_req_index_to_global_index(req, bt, ti, valid_counts_out=counts, **kw)
    with pytest.raises(ValueError, match="overlaps"):
        sparse_mla.convert_req_index_to_global_index(req, bt, ti, valid_counts_out=out[0, :4], **kw)


def test_topk_cached_plans_match_reference_and_check_overlap(seed):
    topk_api._PLANS.clear()
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([50, 7, 0], dtype=torch.int32, device=DEV)
    ws = sparse_mla.topk_workspace(3, DEV)
    for _ in range(2):
        logits = torch.randn(3, 64, generator=g).to(DEV)
        out = torch.full((3, 16), POISON, dtype=torch.int32, device=DEV)
        got = sparse_mla.select_topk(logits, lens, k=16, out=out, workspace=ws, num_splits=2)
        assert torch.equal(got, select_topk_reference(logits, lens, 16))
    assert len(topk_api._PLANS) == 1
    with pytest.raises(ValueError, match="overlaps workspace"):
        sparse_mla.select_topk(logits, lens, k=16, out=ws[:48].view(3, 16), workspace=ws)


# --- the cached launch, against a stand-in for a Triton kernel (no GPU here) ---------------


class _Param:
    def __init__(self, name: str, constexpr: bool, default=None) -> None:
        self.name, self.is_constexpr = name, constexpr
        self.has_default, self.default = default is not None, default


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log: list) -> None:
        self.log = log

    def launch_metadata(self, *a):
        return None

    @property
    def run(self):
        return lambda *a: self.log.append(("fast", a))


class _Kernel:
    """Like a JITFunction: kernel[grid](*args, **kwargs) returns the compiled kernel."""

    def __init__(self, compiled: bool = True) -> None:
        self.params = [_Param("x", False), _Param("n", False), _Param("A", True),
                       _Param("B", True, default=7)]  # fmt: skip
        self.arg_names = [p.name for p in self.params]
        self.log: list = []
        self.compiled = _Compiled(self.log) if compiled else None

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("slow", grid, args, kwargs))
            return self.compiled

        return run


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(_launch, "_driver", lambda: _Driver())
    monkeypatch.setattr(_launch, "_hooks", lambda: (None, None))
    monkeypatch.setattr(_launch._runtime, "INTERPRETER", False)
    monkeypatch.setattr(_launch, "_LAUNCHES", {})
    prev = _launch.set_fast_launch(True)
    yield
    _launch.set_fast_launch(prev)


def kinds(k: _Kernel) -> list[str]:
    return [e[0] for e in k.log]


def test_fast_launch_reuses_the_compiled_kernel_per_specialisation(fast):
    k = _Kernel()
    x = torch.zeros(16, dtype=torch.int32)
    _launch.launch(k, (2,), (x, 32), dict(A=3, num_warps=4))
    _launch.launch(k, (5, 2), (x, 32), dict(A=3, num_warps=4))
    assert kinds(k) == ["slow", "fast"]
    # grid to 3-D, the current stream, the function, then args and constexprs in order.
    assert k.log[1][1] == (5, 2, 1, 1234, "fn", "meta", None, None, None, x, 32, 3, 7)
    # Anything Triton specialises on takes the normal path first.
    _launch.launch(k, (2,), (x, 33), dict(A=3, num_warps=4))  # int value (% 16)
    _launch.launch(k, (2,), (x, 1), dict(A=3, num_warps=4))  # int 1
    _launch.launch(k, (2,), (x[1:], 32), dict(A=3, num_warps=4))  # 16-byte alignment
    _launch.launch(k, (2,), (x.float(), 32), dict(A=3, num_warps=4))  # dtype
    _launch.launch(k, (2,), (x, 32), dict(A=4, num_warps=4))  # constexpr
    _launch.launch(k, (2,), (x, 32), dict(A=3, num_warps=8))  # option
    _launch.launch(k, (2,), (x, True), dict(A=3, num_warps=4))  # a bool is not 1
    _launch.launch(k, (2,), (x, 32), dict(A=3.0, num_warps=4))  # nor a float 3
    assert kinds(k) == ["slow", "fast"] + ["slow"] * 8
    _launch.launch(k, (2,), (x[1:], 32), dict(A=3, num_warps=4))
    assert kinds(k)[-1] == "fast"
    # A caller's key stands for the values (it must fix them).
    _launch.launch(k, (2,), (x, 32), dict(A=3), key="plan")
    _launch.launch(k, (2,), (x, 32), dict(A=3), key="plan")
    assert kinds(k)[-2:] == ["slow", "fast"]


def test_fast_launch_falls_back(fast, monkeypatch):
    x = torch.zeros(16, dtype=torch.int32)
    k = _Kernel(compiled=False)  # Triton returned nothing usable
    for _ in range(3):
        _launch.launch(k, (1,), (x, 32), dict(A=1))
    assert kinds(k) == ["slow"] * 3
    k = _Kernel()
    _launch.launch(k, (1,), (x,), dict(n=32, A=1))  # a runtime argument by keyword
    _launch.launch(k, (1,), (x,), dict(n=32, A=1))
    assert kinds(k) == ["slow"] * 2
    k = _Kernel()
    _launch.launch(k, (1,), (x, [1]), dict(A=1))  # unhashable
    assert kinds(k) == ["slow"]
    k = _Kernel()
    monkeypatch.setattr(_launch._runtime, "INTERPRETER", True)
    for _ in range(2):
        _launch.launch(k, (1,), (x, 32), dict(A=1))
    monkeypatch.setattr(_launch._runtime, "INTERPRETER", False)
    _launch.set_fast_launch(False)
    for _ in range(2):
        _launch.launch(k, (1,), (x, 32), dict(A=1))
    assert kinds(k) == ["slow"] * 4


@pytest.mark.gpu  # the cached launch needs a GPU
def test_fast_launch_on_the_gpu_matches_and_captures(seed):
    # Real compiled kernels: shapes whose integers Triton specialises differently (1, 16,
    # odd), PDL launches (Hopper), a misaligned view, and a CUDA-graph capture of the path.
    prev = _launch.set_fast_launch(True)
    try:
        for t, k in ((1, 64), (16, 128), (5, 40)):
            req, bt, ti = remap_inputs(t, k, seed)
            for view in (ti, torch.cat([ti.flatten(), ti.new_zeros(1)])[1:].view(t, k)):
                want = remap_ref(req, bt, view, block_size=16)
                for _ in range(3):  # normal path, then the cached one
                    got = sparse_mla.convert_req_index_to_global_index(req, bt, view, block_size=16)
                    assert torch.equal(got, want)
        assert any(e is not None for e in _launch._LAUNCHES.values()), "fast path never taken"
        lens = torch.full((4,), 3000, dtype=torch.int32, device=DEV)
        x = torch.randn(4, 4096, device=DEV)
        out = torch.empty(4, 256, dtype=torch.int32, device=DEV)
        ws = sparse_mla.topk_workspace(4, DEV)
        for splits in (None, 1):  # split path (six launches) and the row kernel
            for _ in range(2):
                got = sparse_mla.select_topk(x, lens, k=256, out=out, workspace=ws,
                                             num_splits=splits)  # fmt: skip
                assert torch.equal(got, select_topk_reference(x, lens, 256))
        req, bt, ti = remap_inputs(8, 64, seed)
        out = torch.empty(8, 64, dtype=torch.int32, device=DEV)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            sparse_mla.convert_req_index_to_global_index(req, bt, ti, block_size=16, out=out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                sparse_mla.convert_req_index_to_global_index(req, bt, ti, block_size=16, out=out)
        ti.copy_(remap_inputs(8, 64, seed + 1)[2])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, remap_ref(req, bt, ti, block_size=16))
    finally:
        _launch.set_fast_launch(prev)


@pytest.mark.gpu
def test_fast_launch_matches_the_normal_path_on_every_host_case():
    """Every call the host-cost table times (``sparse_mla.bench.host.host_cases``) gives the
    same outputs through the cached launch as through Triton's: what
    ``benchmarks/gpu_host_cost.py`` checks again before it times the cached launch."""
    from sparse_mla.bench.host import fast_launch_mismatches

    assert fast_launch_mismatches(torch.device("cuda")) == []
    assert any(e is not None for e in _launch._LAUNCHES.values()), "fast path never taken"


def test_expand_and_logits_check_overlap_on_a_cache_hit():
    i32 = dict(dtype=torch.int32, device=DEV)
    seq, bt = torch.tensor([5, 9], **i32), torch.zeros(2, 3, **i32)

    def out(req_id=None):
        bufs = [torch.empty(4, **i32), torch.empty(4, 3, **i32), torch.empty(4, **i32)]
        return sparse_mla.ExpandedDecodeTokens(
            bufs[0], bufs[1], bufs[2], bufs[2] if req_id is None else req_id
        )

    fresh = out(torch.empty(4, **i32))
    sparse_mla.expand_decode_tokens(seq, bt, 2, max_decode_len=2, out=fresh)
    aliased = out()  # the same metadata as `fresh`, but req_id is decode_lens
    with pytest.raises(ValueError, match="out.decode_lens overlaps out.req_id"):
        sparse_mla.expand_decode_tokens(seq, bt, 2, max_decode_len=2, out=aliased)

    cache = sparse_mla.new_indexer_k_cache(2, 16, 32, fp8=False, device=DEV)
    q = torch.randn(2, 4, 32).to(DEV, torch.bfloat16)
    lens, table = torch.tensor([10, 20], **i32), torch.tensor([[0, 1], [1, 0]], **i32)
    logits = torch.empty(2, 32, device=DEV)
    w = torch.empty(2, 32, device=DEV)[:, :4].fill_(1.0)  # strides (32, 1) like out's
    sparse_mla.index_logits(q, w, cache, lens, table, out=logits)
    with pytest.raises(ValueError, match="out overlaps weights"):
        sparse_mla.index_logits(q, logits[:, :4], cache, lens, table, out=logits)
