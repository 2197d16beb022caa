"""Host cost of each public call: microseconds of CPU time per call, beside a bare Triton
launch and ``torch.add_`` measured in the same run (``sparse-mla bench --ops host``,
``benchmarks/gpu_host_cost.py``).

Each call runs ``calls`` times back to back with small shapes (so the GPU stays idle and
the loop measures the host: checks, launch-shape choices, allocations, Triton's launcher),
no synchronisation in the loop, one at the end. The budget of a call is 1.5x a bare launch
per kernel it launches (counted in a first call). ``stub=True`` replaces every Triton launch
by a no-op: what is left is the wrappers' own Python (the CPU measurement of it; kernels
then run nowhere, so results are garbage).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton.language as tl

from .. import _runtime
from .._runtime import jit

#: The budget per kernel launched, in bare 8-argument launches.
BUDGET_PER_LAUNCH = 1.5


@jit
def _bare8(a, b, c, d, n0, n1, n2, n3):
    # Eight arguments (four pointers, four ints), one store: the reference launch.
    tl.store(a + n0 * 0, 1)


def _kernel_classes() -> tuple[type, ...]:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return (JITFunction, InterpretedFunction)


@contextlib.contextmanager
def count_launches() -> Iterator[list[int]]:
    """Counts Triton launches (``kernel[grid](...)``) made inside the block: ``[n]``."""
    n = [0]
    saved = [(cls, cls.run) for cls in _kernel_classes()]

    def wrap(run: Callable) -> Callable:
        def counted(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                n[0] += 1
            return run(self, *args, **kwargs)

        return counted

    for cls, run in saved:
        cls.run = wrap(run)
    try:
        yield n
    finally:
        for cls, run in saved:
            cls.run = run


@contextlib.contextmanager
def stub_launches() -> Iterator[None]:
    """Every Triton launch inside the block does nothing (the wrappers' own cost remains)."""
    saved = [(cls, cls.run) for cls in _kernel_classes()]
    for cls, _ in saved:
        cls.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        for cls, run in saved:
            cls.run = run


@dataclass
class HostCost:
    name: str
    launches: int
    us: float
    budget_us: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.us / self.budget_us if self.budget_us else None


def host_us(
    fn: Callable[[], object], calls: int, device: torch.device, *, wall: bool = False
) -> float:
    """Median over 3 runs of ``calls`` back-to-back calls, microseconds per call: host time
    (the clock stops before the device catches up), or with ``wall`` the time until the
    device has finished too."""
    fn()
    _sync(device)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if wall:
            _sync(device)
        runs.append((time.perf_counter() - t0) * 1e6 / calls)
        _sync(device)
    return sorted(runs)[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_cases(device: torch.device, topk_cols: int = 16384) -> dict[str, Callable[[], object]]:
    """name -> a zero-argument call with small, pre-made inputs (``out=`` buffers given)."""
    import sparse_mla as sm

    i32 = dict(dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)

    def ints(hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, hi, shape, generator=g, dtype=torch.int32).to(device)

    def randn(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    x = torch.zeros(4, device=device)
    bare = [torch.zeros(4, **i32) for _ in range(4)]
    cases: dict[str, Callable[[], object]] = {
        "bare triton launch (8 args)": lambda: _bare8[(1,)](*bare, 1, 2, 3, 4),
        "torch.add_": lambda: x.add_(1),
    }

    t, k, w, page = 4, 2048, 64, 64
    req, bt = torch.arange(t, **i32), ints(1 << 20, t, w)
    ti, out = ints(w * page, t, k), torch.empty(t, k, **i32)
    counts = torch.empty(t, **i32)
    cases["convert_req_index_to_global_index"] = lambda: sm.convert_req_index_to_global_index(
        req, bt, ti, block_size=page, out=out
    )
    cases["filter_and_convert_dcp_index"] = lambda: sm.filter_and_convert_dcp_index(
        req, bt, ti, dcp_size=2, dcp_rank=0, block_size=page, out=out,
        valid_counts_out=counts, return_valid_counts=True,
    )  # fmt: skip

    b, n = 4, 2
    seq, bt_b = ints(1000, b) + 100, ints(1 << 20, b, w)
    exp = sm.ExpandedDecodeTokens(
        torch.empty(b * n, **i32), torch.empty(b * n, w, **i32),
        torch.empty(b * n, **i32), torch.empty(b * n, **i32),
    )  # fmt: skip
    ragged = [1, 2, 2, 1]
    cases["expand_decode_tokens (host uniform)"] = lambda: sm.expand_decode_tokens(
        seq, bt_b, n, max_decode_len=n, out=exp
    )
    cases["expand_decode_tokens (host ragged)"] = lambda: sm.expand_decode_tokens(
        seq, bt_b, ragged, max_decode_len=n, num_tokens=b * n, out=exp
    )
    builder = sm.DecodeMetadataBuilder(b * n, b, w, n, device=device)
    cases["DecodeMetadataBuilder.build (uniform)"] = lambda: builder.build(seq, bt_b, n)
    cases["DecodeMetadataBuilder.build (ragged)"] = lambda: builder.build(seq, bt_b, ragged)

    logits = torch.randn(1, topk_cols, generator=g).to(device)
    lens = torch.full((1,), topk_cols, **i32)
    tk_out, ws = torch.empty(1, k, **i32), sm.topk_workspace(1, device)
    cases[f"select_topk ({topk_cols} cols, out=, workspace=)"] = lambda: sm.select_topk(
        logits, lens, k=k, out=tk_out, workspace=ws
    )
    cases[f"select_topk ({topk_cols} cols, no buffers)"] = lambda: sm.select_topk(logits, lens, k=k)
    vals = torch.empty(1, k, device=device)
    idx = torch.empty(1, k, dtype=torch.int64, device=device)
    cases[f"torch.topk ({topk_cols} cols, out=)"] = lambda: torch.topk(
        logits, k, dim=1, out=(vals, idx)
    )

    num_pages, h, d = 8, 64, 128
    kc = sm.new_indexer_k_cache(num_pages, page, d, fp8=True, device=device)
    slots = torch.arange(t, **i32)
    k_new = randn(t, d)
    cases["write_indexer_k (fp8)"] = lambda: sm.write_indexer_k(k_new, kc, slots)
    mla = sm.new_mla_cache(num_pages, page, fp8=True, device=device)
    kv_c, k_pe = randn(t, 512), randn(t, 64)
    cases["write_mla_latent (fp8)"] = lambda: sm.write_mla_latent(kv_c, k_pe, mla, slots)

    q = randn(t, h, d).to(torch.float8_e4m3fn)
    wts = randn(t, h, dtype=torch.float32)
    il_lens = torch.full((t,), num_pages * page, **i32)
    il_bt = torch.arange(num_pages, **i32).repeat(t, 1)
    il_out = torch.empty(t, num_pages * page, device=device)
    cases["index_logits (fp8)"] = lambda: sm.index_logits(
        q, wts, kc, il_lens, il_bt, max_len=num_pages * page, out=il_out
    )

    hq, topk = 16, 128
    qa = randn(t, hq, 576)
    ind = ints(num_pages * page, t, topk)
    o = torch.empty(t, hq, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(t, hq, device=device)
    aws = sm.attention_workspace(t, hq, topk, cache_format="fp8", device=device)
    cases["sparse_mla_decode (fp8)"] = lambda: sm.sparse_mla_decode(
        qa, mla, ind, sm_scale=0.1, out=o, lse=lse, workspace=aws
    )
    return cases


def measure_host_costs(
    device: torch.device, *, calls: int = 2000, stub: bool = False, topk_cols: int = 16384
) -> list[HostCost]:
    """Host cost of every case (see the module docstring); the bare launch comes first."""
    cases = host_cases(device, topk_cols)
    results: list[HostCost] = []
    for name, fn in cases.items():
        with stub_launches() if stub else contextlib.nullcontext():
            with count_launches() as n:
                fn()
            _sync(device)
            us = host_us(fn, calls, device)
        results.append(HostCost(name, n[0], us))
    bare = results[0].us
    for r in results:
        if r.launches and not r.name.startswith("bare"):
            r.budget_us = BUDGET_PER_LAUNCH * bare * r.launches
    return results


def _snapshot(r: object) -> list[torch.Tensor]:
    """The tensors a call returned, copied (the next call writes the same buffers)."""
    if isinstance(r, torch.Tensor):
        return [r.clone()]
    if isinstance(r, tuple | list):
        return [t for x in r for t in _snapshot(x)]
    if hasattr(r, "__dataclass_fields__"):
        return [t for f in r.__dataclass_fields__ for t in _snapshot(getattr(r, f))]
    return []


def fast_launch_mismatches(device: torch.device, topk_cols: int = 16384) -> list[str]:
    """Cases whose outputs differ between the normal launch path and the cached one (same
    inputs; every kernel here is deterministic). Needs a GPU to mean anything."""
    from .. import _launch

    bad = []
    for name, fn in host_cases(device, topk_cols).items():
        if name.startswith(("bare", "torch.")):  # not ours (and add_ accumulates in place)
            continue
        prev = _launch.set_fast_launch(False)
        try:
            want = _snapshot(fn())
            _launch.set_fast_launch(True)
            fn()  # the first call goes the normal way and keeps the compiled kernel
            got = _snapshot(fn())
        finally:
            _launch.set_fast_launch(prev)
        _sync(device)
        same = len(want) == len(got) and all(
            torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, equal_nan=True))
            for a, b in zip(want, got, strict=False)
        )
        if not same:
            bad.append(name)
    return bad


def eager_topk(
    device: torch.device, ns=(4096, 16384, 65536, 131072), batches=(1, 8, 64), k: int = 2048,
    calls: int = 200,
) -> list[dict]:  # fmt: skip
    """Eager per-call time (host and device together: back-to-back calls, synchronised at
    the end) of ``select_topk`` (auto path; and the one-program-per-row kernel) against
    ``torch.topk`` at the bench's shapes, all with pre-sized outputs."""
    rows = []
    for n in ns:
        for b in batches:
            fns = _topk_calls(device, n, b, k)
            row = {"n": n, "batch": b}
            for name, fn in fns.items():
                with count_launches() as launches:
                    fn()
                row[name] = host_us(fn, calls, device, wall=True)
                row[name + " launches"] = launches[0]
            rows.append(row)
    return rows


def _topk_calls(device: torch.device, n: int, b: int, k: int) -> dict[str, Callable]:
    import sparse_mla as sm

    x = torch.randn(b, n, device=device)
    lens = torch.full((b,), n, dtype=torch.int32, device=device)
    out, ws = torch.empty(b, k, dtype=torch.int32, device=device), sm.topk_workspace(b, device)
    vals = torch.empty(b, k, device=device)
    idx = torch.empty(b, k, dtype=torch.int64, device=device)
    return {
        "select_topk": lambda: sm.select_topk(x, lens, k=k, out=out, workspace=ws),
        "select_topk row kernel": lambda: sm.select_topk(
            x, lens, k=k, out=out, workspace=ws, num_splits=1
        ),
        "torch.topk": lambda: torch.topk(x, k, dim=1, out=(vals, idx)),
    }


def render_topk(rows: list[dict]) -> str:
    head = ("N", "batch", "select_topk", "(launches)", "row kernel", "torch.topk", "ours/torch")
    lines = ["eager top-k, k=2048, us per call (host and GPU, back to back)"]
    lines.append("".join(h.rjust(12) for h in head))
    for r in rows:
        cells = (r["n"], r["batch"], f"{r['select_topk']:.1f}", r["select_topk launches"],
                 f"{r['select_topk row kernel']:.1f}", f"{r['torch.topk']:.1f}",
                 f"{r['select_topk'] / r['torch.topk']:.2f}")  # fmt: skip
        lines.append("".join(str(c).rjust(12) for c in cells))
    return "\n".join(lines)


def render(results: list[HostCost], title: str) -> str:
    rows = [("call", "launches", "host us", "budget us", "x budget")]
    for r in results:
        rows.append(
            (
                r.name,
                str(r.launches),
                f"{r.us:.1f}",
                f"{r.budget_us:.1f}" if r.budget_us else "",
                f"{r.ratio:.2f}" if r.ratio else "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title]
    for row in rows:
        lines.append("  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in
                               enumerate(zip(row, widths, strict=True))))  # fmt: skip
    return "\n".join(lines)


def to_json(results: list[HostCost]) -> list[dict]:
    return [dict(asdict(r), ratio=r.ratio) for r in results]


def run(out_dir: Path, *, calls: int = 2000, fast: bool = True, topk: bool = True) -> dict:
    """Measure, print the tables and write ``out_dir/host.json``: the host cost of every
    call with Triton's normal launch path, and (``fast``, on a GPU) with the cached one
    (its outputs checked against the normal path's first), and (``topk``) eager top-k."""
    from .. import _launch

    device = _runtime.default_device()
    cuda = device.type == "cuda"
    doc: dict = {"info": _runtime.info(), "calls": calls, "budget_per_launch": BUDGET_PER_LAUNCH}
    texts = []
    prev = _launch.set_fast_launch(False)
    try:
        res = measure_host_costs(device, calls=calls)
        doc["normal"] = to_json(res)
        texts.append(render(res, f"host us per call, Triton's launch path ({calls} calls)"))
        if fast and cuda:
            doc["fast_launch_mismatches"] = bad = fast_launch_mismatches(device)
            _launch.set_fast_launch(True)
            res = measure_host_costs(device, calls=calls)
            doc["fast"] = to_json(res)
            title = "host us per call, cached launch (SPARSE_MLA_FAST_LAUNCH=1)"
            texts.append(render(res, title) + f"\noutputs differing from the normal path: {bad}")
    finally:
        _launch.set_fast_launch(prev)
    if not cuda:
        texts.append("(CPU interpreter: the times mean nothing)")
    if topk:
        shapes = {} if cuda else dict(ns=(512,), batches=(2,), k=64, calls=2)
        doc["eager_topk"] = rows = eager_topk(device, **shapes)
        texts.append(render_topk(rows))
    text = "\n\n".join(texts)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "host.txt").write_text(text + "\n")
    return doc
