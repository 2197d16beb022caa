"""``sparse-mla verify``: a randomized, bit-exact sweep of the integer kernels.

Every configuration draws fresh inputs from its own seed, runs our kernel, the plain PyTorch
reference and the tiled-atomic layout (the upstream A/B baseline), and demands bit-identical
results (compacted DCP rows of the atomic layout are compared as sets, since its prefix order
is arbitrary). A failure prints the seed; ``sparse-mla verify --case SEED`` reruns just it.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from ._runtime import default_device, info
from .ops.decode_metadata import expand_decode_tokens
from .ops.decode_metadata.naive import expand_decode_tokens_reference
from .ops.remap import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .ops.remap.naive import convert_req_index_to_global_index_reference

TOPK_WIDTHS = (128, 384, 512, 1024, 2048)
PAGE_SIZES = (16, 64)
INVALID_FRACTIONS = (0.0, 0.05, 0.5, 0.95, 1.0)


@dataclass(frozen=True)
class Case:
    """One configuration of the sweep; ``seed`` alone reproduces its inputs."""

    kind: str  # "remap", "dcp" or "expand"
    seed: int
    params: dict = field(hash=False, compare=False)

    def label(self) -> str:
        p = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.kind} seed={self.seed} {p}"


def _dcp_choices(page: int) -> list[tuple[int, int]]:
    out = [(1, 1)]
    for size in (2, 4):
        out += [(size, i) for i in (1, 16, 64) if page % i == 0]
    return out


def build_cases(quick: bool, base_seed: int = 0) -> list[Case]:
    """The sweep: remap/DCP over K x page x DCP layout x page-stride x invalid fraction,
    then ragged and uniform expansion with padding. ``quick`` keeps a strided subset at
    small token counts (it is meant for the CPU interpreter)."""
    cases: list[Case] = []
    max_tokens = 16 if quick else 1024
    grid = itertools.product(
        TOPK_WIDTHS, PAGE_SIZES, (False, True), INVALID_FRACTIONS, range(3)
    )
    for k, page, strided, invalid, rep in grid:
        for size, inter in _dcp_choices(page):
            if size == 1:
                params = dict(k=k, page=page, strided=strided, invalid=invalid,
                              prefill=rep == 2)
                cases.append(Case("remap", 0, params))
            else:
                params = dict(k=k, page=page, strided=strided, dcp=size, interleave=inter,
                              invalid=invalid, compact=rep != 1)
                cases.append(Case("dcp", 0, params))
    for n, ragged, padded, dcp, _rep in itertools.product(
        (1, 2, 3, 4, 8), (False, True), (False, True), (1, 2, 4), range(4)
    ):
        cases.append(Case("expand", 0, dict(n=n, ragged=ragged, padded=padded, dcp=dcp)))
    out = [
        Case(c.kind, base_seed + i, dict(c.params, max_tokens=max_tokens))
        for i, c in enumerate(cases)
    ]
    if not quick:
        return out
    # The quick subset keeps the seeds of the full sweep's numbering; expansion cases are
    # cheap, so more of them stay.
    return [c for i, c in enumerate(out) if i % (2 if c.kind == "expand" else 7) == 0]


def _log_uniform_int(g: torch.Generator, lo: int, hi: int) -> int:
    u = torch.rand((), generator=g).item()
    return int(round(lo * (hi / lo) ** u))


def _make_remap_inputs(case: Case, g: torch.Generator):
    p = case.params
    k, page = p["k"], p["page"]
    tokens = _log_uniform_int(g, 1, p["max_tokens"])
    num_req = int(torch.randint(1, 9, (), generator=g))
    width = int(torch.randint(1, 40, (), generator=g))
    stride = page * int(torch.randint(2, 5, (), generator=g)) if p.get("strided") else None
    # Row stride wider than the table, as when engines slice a bigger buffer.
    bt_full = torch.randint(0, 5000, (num_req, width + 3), generator=g, dtype=torch.int32)
    block_table = bt_full[:, :width]
    dcp = p.get("dcp", 1)
    # Positions up to 1.25x the addressable range: the tail has out-of-range page ids.
    span = int(width * page * dcp * 1.25) + 1
    idx = torch.randint(0, span, (tokens, k), generator=g, dtype=torch.int32)
    drop = torch.rand((tokens, k), generator=g) < p["invalid"]
    idx[drop] = -1
    req_id = torch.randint(0, num_req, (tokens,), generator=g, dtype=torch.int32)
    kwargs = dict(block_size=page)
    if stride:
        kwargs["block_stride_rows"] = stride
    if p.get("prefill"):
        num_prefill = int(torch.randint(1, 4, (), generator=g))
        ids = torch.randint(-1, num_prefill, (tokens,), generator=g, dtype=torch.int32)
        starts = torch.randint(0, 100000, (num_prefill,), generator=g, dtype=torch.int32)
        kwargs["prefill_request_ids"] = ids
        kwargs["prefill_workspace_starts"] = starts
    return req_id, block_table, idx, kwargs


def _to(dev, *ts):
    return [t.to(dev) if isinstance(t, torch.Tensor) else t for t in ts]


def _run_remap(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    req_id, bt, idx, kwargs = _make_remap_inputs(case, g)
    ref, ref_counts = convert_req_index_to_global_index_reference(
        req_id, bt, idx, return_valid_counts=True, **kwargs
    )
    kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    req_id, bt, idx = _to(dev, req_id, bt, idx)
    for layout in ("auto", "tiled_atomic"):
        out = torch.full_like(idx, -7777)
        got, counts = convert_req_index_to_global_index(
            req_id, bt, idx, return_valid_counts=True, out=out, layout=layout, **kwargs
        )
        if not torch.equal(got.cpu(), ref):
            return f"{layout}: {_first_diff(got.cpu(), ref)}"
        if not torch.equal(counts.cpu(), ref_counts):
            return f"{layout}: valid counts differ"
    return None


def _run_dcp(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    req_id, bt, idx, kwargs = _make_remap_inputs(case, g)
    rank = int(torch.randint(0, p["dcp"], (), generator=g))
    dcp = dict(dcp_size=p["dcp"], dcp_rank=rank, interleave=p["interleave"])
    ref, ref_counts = convert_req_index_to_global_index_reference(
        req_id, bt, idx, compact=p["compact"], return_valid_counts=True, **dcp, **kwargs
    )
    req_id, bt, idx = _to(dev, req_id, bt, idx)
    for layout in ("auto", "tiled_atomic"):
        out = torch.full_like(idx, -7777)
        got, counts = filter_and_convert_dcp_index(
            req_id, bt, idx, compact=p["compact"], return_valid_counts=True, out=out,
            layout=layout, **dcp, **kwargs,
        )
        got = got.cpu()
        if layout == "tiled_atomic" and p["compact"]:
            # Atomic compaction fills the prefix in arbitrary order: compare as sets.
            got, want = got.sort(dim=1).values, ref.sort(dim=1).values
        else:
            want = ref
        if not torch.equal(got, want):
            return f"{layout}: {_first_diff(got, want)}"
        if not torch.equal(counts.cpu(), ref_counts):
            return f"{layout}: valid counts differ"
    return None


def _run_expand(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    n = p["n"]
    num_req = int(torch.randint(0, 33, (), generator=g))
    width = int(torch.randint(1, 70, (), generator=g))
    if p["ragged"]:
        decode_lens = torch.randint(0, n + 1, (num_req,), generator=g, dtype=torch.int32)
    else:
        decode_lens = torch.full((num_req,), n, dtype=torch.int32)
    seq_lens = torch.randint(0, width * 64, (num_req,), generator=g, dtype=torch.int32)
    # Padding requests: no tokens, length 0.
    seq_lens[decode_lens == 0] = 0
    bt = torch.randint(0, 10**6, (num_req, width + 2), generator=g, dtype=torch.int32)[:, :width]
    total = int(decode_lens.sum())
    num_tokens = total + (int(torch.randint(1, 17, (), generator=g)) if p["padded"] else 0)
    rank = int(torch.randint(0, p["dcp"], (), generator=g))
    kw = dict(max_decode_len=n, num_tokens=num_tokens, dcp_size=p["dcp"], dcp_rank=rank)
    ref = expand_decode_tokens_reference(seq_lens, bt, decode_lens, **kw)
    for uniform, lens in ((False, decode_lens.to(dev)), (None, decode_lens.tolist())):
        got = expand_decode_tokens(seq_lens.to(dev), bt.to(dev), lens, uniform=uniform, **kw)
        for name in ("seq_lens", "block_table", "decode_lens", "req_id"):
            a, b = getattr(got, name).cpu(), getattr(ref, name)
            if not torch.equal(a, b):
                return f"uniform={uniform} {name}: {_first_diff(a, b)}"
    return None


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    where = (got != want).nonzero()
    at = tuple(where[0].tolist())
    return f"{len(where)} mismatches, first at {at}: got {got[at].item()} want {want[at].item()}"


RUNNERS = {"remap": _run_remap, "dcp": _run_dcp, "expand": _run_expand}


def run_case(case: Case, dev: torch.device) -> str | None:
    """None when the case passes, else what went wrong (a crash is a failure of the case)."""
    g = torch.Generator().manual_seed(case.seed)
    try:
        return RUNNERS[case.kind](case, g, dev)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"


def _run_chunk(cases: list[Case]) -> list[tuple[Case, str | None]]:
    dev = default_device()
    return [(c, run_case(c, dev)) for c in cases]


def _results(cases: list[Case], jobs: int) -> Iterator[tuple[Case, str | None]]:
    """Run the cases, in ``jobs`` processes when > 1 (kernel compilation dominates a sweep on
    the GPU, and the processes compile different variants side by side)."""
    if jobs <= 1:
        dev = default_device()
        for c in cases:
            yield c, run_case(c, dev)
        return
    chunks = [cases[i : i + 8] for i in range(0, len(cases), 8)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for done in pool.map(_run_chunk, chunks):
            yield from done


def _progress(done: int, total: int, failed: int, t0: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.time() - t0, 1e-9)
    eta = (total - done) / max(rate, 1e-9)
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
        f"failed={failed} {rate:.1f}/s eta {eta:.0f}s "
    )
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sparse-mla verify", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a few hundred small configurations")
    ap.add_argument("--seed", type=int, default=0, help="base seed of the sweep")
    ap.add_argument("--case", type=int, default=None, help="rerun only the case with this seed")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    dev = default_device()
    cases = build_cases(args.quick, args.seed)
    if args.case is not None:
        cases = [c for c in cases if c.seed == args.case]
        if not cases:
            print(f"no case with seed {args.case}", file=sys.stderr)
            return 2
    print(" ".join(f"{k}={v}" for k, v in info().items()))
    print(f"{len(cases)} configurations on {dev}")

    passed: Counter = Counter()
    failed: Counter = Counter()
    failures: list[str] = []
    t0 = time.time()
    for i, (case, err) in enumerate(_results(cases, args.jobs)):
        key = (case.kind, case.params.get("k", case.params.get("n")))
        if err is None:
            passed[key] += 1
        else:
            failed[key] += 1
            failures.append(f"FAIL {case.label()}: {err}")
        if not args.no_progress and (i % 10 == 0 or i == len(cases) - 1):
            _progress(i + 1, len(cases), sum(failed.values()), t0)
    if not args.no_progress:
        sys.stderr.write("\n")

    print(f"\n{'kind':8} {'K / n':>6} {'passed':>7} {'failed':>7}")
    for key in sorted(set(passed) | set(failed), key=lambda k: (k[0], k[1])):
        print(f"{key[0]:8} {key[1]:>6} {passed[key]:>7} {failed[key]:>7}")
    total_failed = sum(failed.values())
    print(
        f"{sum(passed.values())} passed, {total_failed} failed "
        f"in {time.time() - t0:.1f}s"
    )
    for line in failures:
        print(line)
    if failures:
        quick = " --quick" if args.quick else ""
        print(f"reproduce one with: sparse-mla verify{quick} --seed {args.seed} --case SEED")
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
