"""Timing primitives: per-call time inside a CUDA graph and eagerly, the in-graph launch cost of
an empty Triton kernel, and device-to-device copy bandwidth. The one CUDA-graph timer
(:func:`measure_graph`, or :func:`graph_us` for a plain number) used by ``sparse-mla bench``,
the tests and the GPU scripts.

Everything goes through a small :class:`Backend` so the logic (rotation over input sets,
division by the number of calls, medians, sizing) runs the same on the GPU, in the CPU
interpreter smoke mode, and under a fake clock in the tests.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton.language as tl

from .. import _runtime
from .._runtime import jit, pdl_launch, pdl_prologue

Call = Callable[[], object]

# H200 L2 is 60 MB (the figure); used only when the device does not report its size.
DEFAULT_L2_BYTES = 60 * 1000 * 1000


@jit
def _empty_kernel(ptr, PDL: tl.constexpr):
    # One program writing one int: the cheapest kernel that is guaranteed to run.
    pdl_prologue(PDL)
    tl.store(ptr, 1)


class Backend:
    """Where and how time is measured. Subclasses: :class:`CudaBackend`, :class:`CpuBackend`."""

    name: str = "abstract"
    #: True when :meth:`capture` really records a CUDA graph (False: replay is an eager loop).
    graphs: bool = False
    device: torch.device = torch.device("cpu")
    l2_bytes: int = 0
    #: False: skip the sizing probe (every variant gets the full calls and repetitions).
    probe: bool = True

    def synchronize(self) -> None:
        raise NotImplementedError

    def time_ms(self, fn: Call, reps: int) -> list[float]:
        """Run ``fn`` ``reps`` times back to back; milliseconds of each run."""
        raise NotImplementedError

    def capture(self, body: Call) -> Call:
        """Record ``body`` (already warmed up) once; return a zero-argument replay."""
        raise NotImplementedError

    def release(self) -> None:
        """Give cached memory back between cases."""

    def device_name(self) -> str:
        return self.name


class CudaBackend(Backend):
    name = "cuda"
    graphs = True

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def time_ms(self, fn: Call, reps: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize()
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]

    def capture(self, body: Call) -> Call:
        # Warm up on a side stream first (what torch.cuda.graph's documentation asks for), then
        # record. Allocations made by the body (PyTorch-op baselines) land in the graph's pool.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        torch.cuda.synchronize()
        return graph.replay  # the bound method keeps the graph (and its pool) alive

    def release(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)


class CpuBackend(Backend):
    """Triton-interpreter smoke mode: host clock, no graphs (replay runs the body eagerly).
    The numbers mean nothing; the point is to run every code path end to end."""

    name = "cpu"
    graphs = False
    probe = False  # each interpreted call costs a second: run every variant as few times as we can

    def __init__(self, l2_bytes: int = 1 << 20) -> None:
        # A nominal 1 MiB "cache" so the input-set rotation logic is exercised too.
        self.device = torch.device("cpu")
        self.l2_bytes = l2_bytes

    def synchronize(self) -> None:
        pass

    def time_ms(self, fn: Call, reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def capture(self, body: Call) -> Call:
        return body

    def device_name(self) -> str:
        return "CPU (Triton interpreter)"


def select_backend(allow_cpu: bool) -> Backend | None:
    """CUDA when kernels compile for a GPU; the CPU smoke backend only if ``allow_cpu``."""
    if not _runtime.INTERPRETER and torch.cuda.is_available():
        return CudaBackend()
    return CpuBackend() if allow_cpu else None


@dataclass
class Timing:
    """Per-call times (microseconds) over ``reps`` repetitions of ``calls`` back-to-back calls."""

    median_us: float
    min_us: float
    max_us: float
    calls: int
    reps: int

    @classmethod
    def from_samples(cls, per_call_us: Sequence[float], calls: int) -> Timing:
        us = [float(x) for x in per_call_us]
        return cls(statistics.median(us), min(us), max(us), calls, len(us))


def rotation(calls: Sequence[Call], n: int) -> Call:
    """A body making ``n`` calls back to back, cycling through ``calls`` (one per input set)."""
    if not calls:
        raise ValueError("rotation needs at least one call")
    seq = [calls[i % len(calls)] for i in range(n)]

    def body() -> None:
        for c in seq:
            c()

    return body


def _timed(body: Call, calls: int, *, reps: int, warmup: int, backend: Backend) -> Timing:
    """``warmup`` untimed runs of ``body`` (``calls`` calls), then ``reps`` timed ones."""
    for _ in range(warmup):
        body()
    backend.synchronize()
    return Timing.from_samples([m * 1e3 / calls for m in backend.time_ms(body, reps)], calls)


def measure_graph(
    calls: Sequence[Call], *, graph_calls: int, reps: int, warmup: int, backend: Backend
) -> Timing:
    """Capture ``graph_calls`` back-to-back calls (rotating over ``calls``) into one graph,
    replay it ``warmup`` times, then time ``reps`` replays; per call = replay / graph_calls."""
    replay = backend.capture(rotation(calls, graph_calls))
    return _timed(replay, graph_calls, reps=reps, warmup=warmup, backend=backend)


def measure_eager(
    calls: Sequence[Call], *, n_calls: int, reps: int, warmup: int, backend: Backend
) -> Timing:
    """Events around ``n_calls`` eager back-to-back calls (rotating), ``reps`` times."""
    return _timed(rotation(calls, n_calls), n_calls, reps=reps, warmup=warmup, backend=backend)


def _listed(calls: Call | Sequence[Call]) -> list[Call]:
    return [calls] if callable(calls) else list(calls)


def graph_us(
    calls: Call | Sequence[Call],
    *,
    graph_calls: int | None = None,
    reps: int = 20,
    warmup: int = 3,
    backend: Backend | None = None,
) -> float:
    """Median per-call microseconds of ``graph_calls`` back-to-back calls (default: one of each
    of ``calls``, rotating) captured in one CUDA graph (:func:`measure_graph`). ``backend``:
    CUDA where kernels compile for a GPU, else the CPU host clock (a dry run: no graph)."""
    calls = _listed(calls)
    backend = backend or select_backend(allow_cpu=True)
    n = graph_calls or len(calls)
    return measure_graph(calls, graph_calls=n, reps=reps, warmup=warmup, backend=backend).median_us


def eager_us(
    calls: Call | Sequence[Call],
    *,
    n_calls: int = 1,
    reps: int = 20,
    warmup: int = 3,
    backend: Backend | None = None,
) -> float:
    """Median per-call microseconds of ``n_calls`` eager back-to-back calls (rotating over
    ``calls``), events around each repetition (:func:`measure_eager`)."""
    backend = backend or select_backend(allow_cpu=True)
    timing = measure_eager(
        _listed(calls), n_calls=n_calls, reps=reps, warmup=warmup, backend=backend
    )
    return timing.median_us


def probe_us(calls: Sequence[Call], backend: Backend, n: int = 4) -> float:
    """Rough eager per-call time, used only to size the real measurements."""
    ms = backend.time_ms(rotation(calls, n), 1)[0]
    return ms * 1e3 / n


def plan_sizes(
    est_us: float,
    *,
    max_calls: int,
    max_reps: int,
    budget_ms: float,
    min_calls: int = 8,
    min_reps: int = 5,
) -> tuple[int, int]:
    """(calls per repetition, repetitions) so that calls * reps * est stays within the budget.

    Fast kernels get the full ``max_calls x max_reps``; slow ones (PyTorch-op baselines on large
    inputs) lose calls first, then repetitions, never below ``min_calls`` / ``min_reps``."""
    min_calls = min(min_calls, max_calls)
    min_reps = min(min_reps, max_reps)
    est_ms = max(est_us, 1e-3) * 1e-3
    calls, reps = max_calls, max_reps
    if calls * reps * est_ms > budget_ms:
        calls = max(min_calls, int(budget_ms / (reps * est_ms)))
    if calls * reps * est_ms > budget_ms:
        reps = max(min_reps, int(budget_ms / (calls * est_ms)))
    return calls, reps


def rotation_sets(
    set_bytes: int, l2_bytes: int, *, max_sets: int, mem_cap_bytes: int = 2 << 30
) -> int:
    """How many independent input sets to rotate through.

    Enough sets that the working set is at least twice the L2 (so a call does not find its
    inputs left in L2 by the previous call on the same set), but never more than one set per
    call in the graph (``max_sets``) nor more than ``mem_cap_bytes`` of inputs. Small cases stay
    L2-resident anyway; the report flags those (which is also what an engine sees: the top-k
    kernel that produced the indices just wrote them)."""
    if set_bytes <= 0:
        return 1
    n = math.ceil(2 * l2_bytes / set_bytes)
    n = min(n, max_sets, mem_cap_bytes // set_bytes)
    return max(1, n)


def measure_launch_floor(
    backend: Backend, *, graph_calls: int, reps: int, warmup: int = 3, pdl: int = 0
) -> tuple[Timing, Timing]:
    """(in-graph, eager) per-launch time of a one-program Triton kernel that stores one int;
    with ``pdl`` its launches use programmatic dependent launch in that mode (where
    supported), as the kernels that use it do."""
    buf = torch.zeros(1, dtype=torch.int32, device=backend.device)
    kw = pdl_launch(backend.device, pdl)

    def call() -> None:
        _empty_kernel[(1,)](buf, **kw)

    call()
    backend.synchronize()
    g = measure_graph([call], graph_calls=graph_calls, reps=reps, warmup=warmup, backend=backend)
    e = measure_eager([call], n_calls=graph_calls, reps=reps, warmup=1, backend=backend)
    return g, e


def measure_copy_bandwidth(backend: Backend, nbytes: int, *, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (2 * nbytes per copy). Median over ``reps`` copies after two warm-up copies."""
    n = max(nbytes // 4, 1)
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=backend.device)
    bufs = [src, torch.empty_like(src)]
    moved = 2 * src.numel() * src.element_size()
    del src

    def copy() -> None:
        bufs[1].copy_(bufs[0])

    for _ in range(2):
        copy()
    backend.synchronize()
    ms = statistics.median(backend.time_ms(copy, reps))
    bufs.clear()
    backend.release()
    return moved / (ms * 1e-3)
