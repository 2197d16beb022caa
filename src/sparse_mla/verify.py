"""``sparse-mla verify``: a randomized sweep of every kernel against its reference.

Every configuration draws fresh inputs from its own seed and compares our kernel with the plain
PyTorch reference. Kinds:

* ``remap``, ``dcp``: the index remap and the DCP filter, also with the tiled-atomic layout
  (the upstream A/B baseline) and, without compaction, the flat layout at every size;
  bit-identical (compacted DCP rows of the atomic layout are compared as sets, since its
  prefix order is arbitrary).
* ``expand``: speculative-decode expansion (uniform and ragged kernels; decode lengths on the
  host, on the device, or as row offsets), bit-identical.
* ``topk``: exact top-k under adversarial score distributions (normal, all equal, ties at the
  threshold, two-valued, -inf runs, NaN, huge/tiny magnitudes, signed zeros) and lengths
  0 / < k / = k / > k, on the row, split (prefilter on, off or by default; its candidates
  marked or copied out) and automatic paths; bit-identical to ``select_topk_reference``,
  and the fused slot epilogue bit-identical to top-k followed by the remap.
* ``kvcache``: the indexer-K and MLA-latent writers (bf16 and fp8 formats, V3.2's and
  DeepSeek-V4's MODEL1, ``-1`` and
  out-of-range slots, garbage-filled caches) byte-identical to the PyTorch writers.
* ``logits``: indexer logits (bf16 and fp8 caches, native multi-token, flattened and 2-D
  lengths, hostile lengths and page ids) against the fp64 reference within the tolerance of
  ``tests/ops/test_indexer.py``, with the ``-inf`` pattern exact.

The full sweep (2456 configurations: 2040 remap/dcp/expand, 192 topk, 72 kvcache, 72 logits,
68 attention, 12 decode_step: the whole step of ``sparse_mla.decode`` against its PyTorch
reference)
uses the model's sizes (k 512 and 2048 of rows up to 64K scores; 64 heads x 128 dims, page 64,
contexts up to 16K); ``--quick`` (483) runs a subset at interpreter sizes (k 128/256, rows up to
2000 scores, 8 heads x 32 dims), ``--kind`` keeps only some kinds.
A failure prints the case's label with its seed; ``sparse-mla verify --case SEED`` reruns just
it (with ``--quick`` when it came from the quick sweep).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from ._runtime import cdiv, default_device, info
from .decode.cases import check_random_step
from .ops.decode_metadata import expand_decode_tokens
from .ops.decode_metadata.naive import expand_decode_tokens_reference
from .ops.indexer import index_logits, index_logits_reference
from .ops.kv_cache import new_indexer_k_cache, new_mla_cache, write_indexer_k, write_mla_latent
from .ops.kv_cache.naive import (
    write_indexer_k_reference,
    write_mla_latent_reference,
    write_model1_latent_reference,
)
from .ops.remap import (
    RemapLayout,
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)
from .ops.remap.naive import convert_req_index_to_global_index_reference
from .ops.topk import (
    TopKConfig,
    positions_to_slots_reference,
    select_topk,
    select_topk_reference,
    topk_workspace,
)
from .testing import POISON, logits_error

TOPK_WIDTHS = (128, 384, 512, 1024, 2048)
PAGE_SIZES = (16, 64)
INVALID_FRACTIONS = (0.0, 0.05, 0.5, 0.95, 1.0)

# Score distributions and shapes of the top-k cases.
TOPK_DISTS = (
    "normal",
    "all_equal",
    "threshold_ties",
    "two_valued",
    "neg_inf_runs",
    "nan",
    "huge_tiny",
    "signed_zeros",
)
# short: N <= k (every row takes the short path); row / split: N > k on the one-program-per-row
# kernel / the split kernels (num_splits forced); auto: N > k, launch shape from the heuristic.
TOPK_MODES = ("short", "row", "split", "auto")
KV_CACHES = ("indexer_bf16", "indexer_fp8", "mla_bf16", "mla_fp8", "model1_bf16", "model1_fp8")
# Per-case repetitions of the new kinds in the full sweep; the quick sweep keeps fewer.
TOPK_REPS, KV_REPS, LOGITS_REPS = 3, 6, 6
DECODE_STEP_REPS = 12


@dataclass(frozen=True)
class Sizes:
    """Shapes of the topk, kvcache and logits cases (quick: interpreter sizes; full: GPU)."""

    topk_k: tuple[int, int]
    topk_max_n: int
    topk_max_rows: int
    kv_dims: tuple[int, ...]
    kv_pages: tuple[int, ...]
    kv_max_tokens: int
    logits_heads: int
    logits_dim: int
    logits_page: int
    logits_max_width: int
    logits_max_req: int
    logits_next_n: tuple[int, ...]


QUICK_SIZES = Sizes(
    topk_k=(128, 256),
    topk_max_n=2000,
    topk_max_rows=8,
    kv_dims=(32, 64, 128),
    kv_pages=(16, 64),
    kv_max_tokens=300,
    logits_heads=8,
    logits_dim=32,
    logits_page=16,
    logits_max_width=32,
    logits_max_req=5,
    logits_next_n=(1, 2, 3, 4, 6, 8),
)
FULL_SIZES = Sizes(
    topk_k=(512, 2048),
    topk_max_n=65536,
    topk_max_rows=12,
    kv_dims=(128,),
    kv_pages=(16, 64),
    kv_max_tokens=20000,
    logits_heads=64,
    logits_dim=128,
    logits_page=64,
    logits_max_width=256,  # contexts up to 16K (the fp64 reference runs on the CPU)
    logits_max_req=8,
    logits_next_n=(1, 2, 3, 4, 6, 8),  # 6 and 8: two token groups of 4 at 64 heads
)


@dataclass(frozen=True)
class Case:
    """One configuration of the sweep; ``seed`` alone reproduces its inputs."""

    kind: str  # "remap", "dcp", "expand", "topk", "kvcache", "logits", "attention", "decode_step"
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


def _new_kind_cases(sz: Sizes) -> list[tuple[Case, bool]]:
    """The topk, kvcache and logits grids, each case with "kept by the quick sweep"."""
    out: list[tuple[Case, bool]] = []
    for rep, dist, ki, mode in itertools.product(
        range(TOPK_REPS), TOPK_DISTS, range(len(sz.topk_k)), TOPK_MODES
    ):
        params = dict(
            dist=dist,
            k=sz.topk_k[ki],
            mode=mode,
            max_n=sz.topk_max_n,
            max_rows=sz.topk_max_rows,
        )
        out.append((Case("topk", 0, params), rep == 0))
    for rep, cache, page in itertools.product(range(KV_REPS), KV_CACHES, sz.kv_pages):
        params = dict(cache=cache, page=page, dims=sz.kv_dims, max_tokens=sz.kv_max_tokens)
        out.append((Case("kvcache", 0, params), rep < 4))
    for rep, fp8, n in itertools.product(range(LOGITS_REPS), (False, True), sz.logits_next_n):
        params = dict(
            fp8=fp8,
            n=n,
            heads=sz.logits_heads,
            dim=sz.logits_dim,
            page=sz.logits_page,
            max_width=sz.logits_max_width,
            max_req=sz.logits_max_req,
        )
        # n = 6 and 8 (two token groups of 4 at 64 heads) run in the full sweep only.
        out.append((Case("logits", 0, params), rep < 4 and n <= 4))
    return out


def build_cases(quick: bool, base_seed: int = 0) -> list[Case]:
    """The sweep: remap/DCP over K x page x DCP layout x page-stride x invalid fraction,
    ragged and uniform expansion with padding, then top-k, the cache writers and the indexer
    logits. ``quick`` keeps a strided subset at small sizes (it is meant for the CPU
    interpreter); each case keeps the seed of its position in the full sweep."""
    cases: list[Case] = []
    max_tokens = 16 if quick else 1024
    grid = itertools.product(TOPK_WIDTHS, PAGE_SIZES, (False, True), INVALID_FRACTIONS, range(3))
    for k, page, strided, invalid, rep in grid:
        for size, inter in _dcp_choices(page):
            if size == 1:
                params = dict(k=k, page=page, strided=strided, invalid=invalid, prefill=rep == 2)
                cases.append(Case("remap", 0, params))
            else:
                params = dict(
                    k=k,
                    page=page,
                    strided=strided,
                    dcp=size,
                    interleave=inter,
                    invalid=invalid,
                    compact=rep != 1,
                )
                cases.append(Case("dcp", 0, params))
    for n, ragged, padded, dcp, _rep in itertools.product(
        (1, 2, 3, 4, 8), (False, True), (False, True), (1, 2, 4), range(4)
    ):
        cases.append(Case("expand", 0, dict(n=n, ragged=ragged, padded=padded, dcp=dcp)))
    # The quick subset: DCP layouts outnumber plain remaps 5:1 in the grid, so plain remaps
    # are kept more densely; one of the four repetitions of each expansion case.
    stride = {"remap": 3, "dcp": 9, "expand": 4}
    keep = [i % stride[c.kind] == 0 for i, c in enumerate(cases)]
    cases = [Case(c.kind, c.seed, dict(c.params, max_tokens=max_tokens)) for c in cases]
    for c, q in _new_kind_cases(QUICK_SIZES if quick else FULL_SIZES):
        cases.append(c)
        keep.append(q)
    for c, q in _attention_cases(quick):
        cases.append(c)
        keep.append(q)
    for rep in range(DECODE_STEP_REPS):  # the whole decode step against its reference
        cases.append(Case("decode_step", 0, {}))
        keep.append(rep < 2)
    out = [Case(c.kind, base_seed + i, c.params) for i, c in enumerate(cases)]
    if not quick:
        return out
    return [c for c, q in zip(out, keep, strict=True) if q]


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


def _tiled_atomic_layout(k: int) -> RemapLayout:
    """Upstream's tiling (``benchmarks/baselines``; K a multiple of 128): 128-wide column
    tiles of 4 warps that count and compact through atomics."""
    return RemapLayout(1, 128, 1, k // 128, True, False, 4)


def _flat_layout(k: int) -> RemapLayout:
    """Four rows a program as one flat run in 512-wide steps: the layout ``auto`` picks for
    large calls of odd widths, here at every size and width (it takes no compaction)."""
    return RemapLayout(4, 512, -(-4 * k // 512), 1, False, True, 4, flat=True)


def _run_remap(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    req_id, bt, idx, kwargs = _make_remap_inputs(case, g)
    ref, ref_counts = convert_req_index_to_global_index_reference(
        req_id, bt, idx, return_valid_counts=True, **kwargs
    )
    kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    req_id, bt, idx = _to(dev, req_id, bt, idx)
    for layout in ("auto", _tiled_atomic_layout(idx.shape[1]), _flat_layout(idx.shape[1])):
        out = torch.full_like(idx, POISON)
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
    layouts = ["auto", _tiled_atomic_layout(idx.shape[1])]
    layouts += [] if p["compact"] else [_flat_layout(idx.shape[1])]
    for layout in layouts:
        out = torch.full_like(idx, POISON)
        got, counts = filter_and_convert_dcp_index(
            req_id,
            bt,
            idx,
            compact=p["compact"],
            return_valid_counts=True,
            out=out,
            layout=layout,
            **dcp,
            **kwargs,
        )
        got = got.cpu()
        if layout != "auto" and layout.atomic and p["compact"]:
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
    # Device lengths (each program sums them), host-known ones (the uniform kernel, or the
    # ragged one given row offsets), and device row offsets (query_start_loc).
    offsets = torch.cumsum(torch.cat([decode_lens.new_zeros(1), decode_lens]), 0).int()
    forms = (
        ("device decode_lens", dict(decode_lens=decode_lens.to(dev), uniform=False)),
        ("host decode_lens", dict(decode_lens=decode_lens.tolist())),
        ("query_start_loc", dict(query_start_loc=offsets.to(dev))),
    )
    for form, lens in forms:
        got = expand_decode_tokens(seq_lens.to(dev), bt.to(dev), **lens, **kw)
        for name in ("seq_lens", "block_table", "decode_lens", "req_id"):
            a, b = getattr(got, name).cpu(), getattr(ref, name)
            if not torch.equal(a, b):
                return f"{form} {name}: {_first_diff(a, b)}"
    return None


# ---- top-k -----------------------------------------------------------------------------------


def _rand_int(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (), generator=g))


def _rand_choice(g: torch.Generator, options: tuple | list):
    return options[_rand_int(g, 0, len(options) - 1)]


def _topk_scores(dist: str, rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """fp32 ``[rows, n]`` scores drawn from one of the adversarial distributions."""
    inf, nan = float("inf"), float("nan")
    x = torch.randn(rows, n, generator=g)

    def coin(p: float) -> torch.Tensor:
        return torch.rand(rows, n, generator=g) < p

    if dist == "normal":
        return x * 10.0 ** _rand_int(g, -3, 3)
    if dist == "all_equal":
        return torch.full((rows, n), float(torch.randn((), generator=g)))
    if dist == "threshold_ties":
        if _rand_int(g, 0, 1):  # few distinct values: every threshold is a long tie
            return torch.randint(0, _rand_int(g, 2, 8), (rows, n), generator=g).float()
        # A large share of each row equals the row's k-th largest score.
        kth = x.sort(dim=1, descending=True).values[:, min(k, n) - 1 : min(k, n)]
        return torch.where(coin(0.05 + 0.6 * float(torch.rand((), generator=g))), kth, x)
    if dist == "two_valued":
        a, b = torch.randn(2, generator=g).tolist()
        return torch.where(coin(float(torch.rand((), generator=g))), a, b)
    if dist == "neg_inf_runs":
        for r in range(rows):
            for _ in range(_rand_int(g, 1, 5)):
                start = _rand_int(g, 0, n - 1)
                x[r, start : start + _rand_int(g, 1, max(1, n // 2))] = -inf
        if rows > 1 and _rand_int(g, 0, 1):
            x[_rand_int(g, 0, rows - 1)] = -inf  # a row of -inf only
        return x
    if dist == "nan":
        x[coin(_rand_choice(g, (0.01, 0.3, 0.95)))] = nan
        x[coin(0.05)] = -inf
        x[coin(0.01)] = inf
        if _rand_int(g, 0, 1):
            x[_rand_int(g, 0, rows - 1)] = nan  # a row of NaN only
        return x
    if dist == "huge_tiny":
        # Magnitudes from denormal to overflow (-> inf), and a pool of extreme values.
        exp = torch.randint(-46, 40, (rows, n), generator=g).double()
        scaled = (x.double() * torch.pow(10.0, exp)).float()
        pool = torch.tensor(
            [3.4e38, -3.4e38, 1e30, -1e30, 1e-38, -1e-38, 1e-45, -1e-45, inf, -inf, 0.0, 1.0]
        )
        picks = pool[torch.randint(0, len(pool), (rows, n), generator=g)]
        return torch.where(coin(0.3), picks, scaled)
    if dist == "signed_zeros":
        z = torch.where(coin(0.5), 0.0, -0.0)
        z[coin(0.03)] = 1e-45
        z[coin(0.03)] = -1e-45
        z[coin(0.2)] = -1.0
        return z
    raise ValueError(f"unknown score distribution {dist!r}")


def _topk_lengths(rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """int32 [rows]: the full row first, then 0, < k, = k, > k, past N, negative, random."""
    pool = [0, _rand_int(g, 1, max(1, k - 1)), k, k + 1, n - 1, n + 7, -3]
    pool = [pool[i] for i in torch.randperm(len(pool), generator=g).tolist()]
    vals = [n] + pool + [_rand_int(g, 0, n) for _ in range(rows)]
    return torch.tensor(vals[:rows], dtype=torch.int32)


def _run_topk(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    """One top-k case, its prefilter (when it runs) marking the candidates or copying them
    out, drawn at random (the choice is otherwise by size)."""
    marked = _rand_int(g, 0, 1) == 1
    config = TopKConfig(prefilter_mark_min_scores=0 if marked else 1 << 62)
    err = _run_topk_case(case, g, dev, config)
    return err and f"prefilter marks={marked} {err}"


def _run_topk_case(
    case: Case, g: torch.Generator, dev: torch.device, config: TopKConfig
) -> str | None:
    p = case.params
    k, mode = p["k"], p["mode"]
    rows = _rand_int(g, 4, max(4, p["max_rows"]))
    num_splits: int | None = None
    if mode == "short":
        n = k if _rand_int(g, 0, 2) == 0 else _rand_int(g, 1, k)
        num_splits = _rand_choice(g, (None, 1))
    else:
        lo = k + 1 if mode != "split" else max(k, config.split_block) + 1
        n = _log_uniform_int(g, lo, max(lo, p["max_n"]))
        if mode == "row":
            num_splits = 1
        elif mode == "split":
            num_splits = _rand_int(g, 2, min(32, cdiv(n, config.split_block)))
    prefilter = _rand_choice(g, (None, True, False)) if mode == "split" else None
    x = _topk_scores(p["dist"], rows, n, k, g)
    lengths = _topk_lengths(rows, n, k, g)
    want = select_topk_reference(x, lengths, k)
    want_counts = lengths.clamp(0, n).clamp_max(k)

    xd, ld = x.to(dev), lengths.to(dev)
    ws = topk_workspace(rows, dev)  # reused by the fused call: the kernels re-zero it
    out = torch.full((rows, k), POISON, dtype=torch.int32, device=dev)
    got, counts = select_topk(
        xd,
        ld,
        k=k,
        out=out,
        return_valid_counts=True,
        workspace=ws,
        num_splits=num_splits,
        prefilter=prefilter,
        config=config,
    )
    err = _compare("positions", got.cpu(), want) or _compare("counts", counts.cpu(), want_counts)
    if err:
        return f"n={n} rows={rows} num_splits={num_splits} prefilter={prefilter}: {err}"

    # Fused slot epilogue vs top-k then the remap (and vs the reference of both).
    bs = _rand_choice(g, (64, 64, 16, 1))
    stride = _rand_choice(g, (None, bs * _rand_int(g, 2, 4)))
    num_req = _rand_int(g, 1, 6)
    pages = cdiv(n, bs)
    width = _rand_int(g, max(1, pages // 2), pages + 1)  # short tables: tails map to -1
    bt = torch.randint(0, 100_000, (num_req, width + 3), generator=g, dtype=torch.int32)
    bt = bt[:, :width]
    req = torch.randint(0, num_req, (rows,), generator=g, dtype=torch.int32)
    if _rand_int(g, 0, 1):
        req[_rand_int(g, 0, rows - 1)] = _rand_choice(g, (-1, num_req))  # row outside [0, R)
    want_slots, want_slot_counts = positions_to_slots_reference(
        want, bt, req, block_size=bs, block_stride_rows=stride
    )
    btd, reqd = bt.to(dev), req.to(dev)
    two_step, two_counts = convert_req_index_to_global_index(
        reqd, btd, got, block_size=bs, block_stride_rows=stride, return_valid_counts=True
    )
    out.fill_(POISON)
    fused, fused_counts = select_topk(
        xd,
        ld,
        k=k,
        out=out,
        block_table=btd,
        req_id=reqd,
        block_size=bs,
        block_stride_rows=stride,
        return_valid_counts=True,
        workspace=ws,
        num_splits=num_splits,
        prefilter=prefilter,
        config=config,
    )
    err = (
        _compare("fused slots vs two-step", fused.cpu(), two_step.cpu())
        or _compare("fused counts vs two-step", fused_counts.cpu(), two_counts.cpu())
        or _compare("fused slots vs reference", fused.cpu(), want_slots)
        or _compare("fused counts vs reference", fused_counts.cpu(), want_slot_counts)
    )
    if err:
        return f"n={n} rows={rows} num_splits={num_splits} block_size={bs}: {err}"
    return None


# ---- KV-cache writers ------------------------------------------------------------------------


def _garbage_like(cache: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The cache filled with random bits: untouched slots must keep them."""
    if cache.dtype == torch.uint8:
        return torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8)
    return torch.randn(cache.shape, generator=g).to(cache.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a (contiguous) cache, for a bitwise comparison."""
    return t.contiguous().view(torch.uint8)


def _rand_rows(g: torch.Generator, tokens: int, dim: int) -> torch.Tensor:
    """bf16 [tokens, dim]: each token at its own magnitude (all-zero and below both fp8
    scale floors included), sometimes as a strided view of a wider tensor. About a quarter of the
    tokens sit on a scale boundary: every 128th value is +-448 * 2**e and the rest are
    smaller, so each quantisation group's amax / 448 is exactly a power of two."""
    scale = torch.tensor([0.0, 1e-7, 1e-3, 1.0, 30.0, 1e4, 1e30])
    mag = scale[torch.randint(0, len(scale), (tokens, 1), generator=g)]
    wide = torch.randn(tokens, dim + 5, generator=g) * mag
    edge = torch.rand(tokens, generator=g) < 0.25
    top = 448.0 * torch.exp2(torch.randint(-12, 13, (tokens, 1), generator=g).float())
    bounded = (torch.rand(tokens, dim + 5, generator=g) * 2 - 1) * top * 0.99
    sign = torch.randint(0, 2, (tokens, 1), generator=g) * 2 - 1
    start = _rand_int(g, 0, 5)
    bounded[:, start::128] = top * sign
    wide = torch.where(edge[:, None], bounded, wide).bfloat16()
    return wide[:, start : start + dim]


def _run_kvcache(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    cache_kind, page = p["cache"], p["page"]
    fp8 = cache_kind.endswith("fp8")
    tokens = _log_uniform_int(g, 1, p["max_tokens"])
    num_pages = cdiv(tokens, page) + _rand_int(g, 0, 4)
    num_slots = num_pages * page
    # Distinct slots (two tokens on one slot race), then padding (-1), negative and
    # out-of-range ids, all of which the writers skip.
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots = torch.cat([slots, torch.arange(num_slots, num_slots + tokens)])[:tokens]
    drop = torch.rand(tokens, generator=g) < _rand_choice(g, (0.0, 0.1, 0.5, 1.0))
    slots[drop] = -1
    odd = torch.rand(tokens, generator=g) < 0.05
    slots[odd] = torch.tensor([-5, num_slots, num_slots + 10**6])[
        torch.randint(0, 3, (int(odd.sum()),), generator=g)
    ]
    slots = slots.to(_rand_choice(g, (torch.int32, torch.int64)))
    if cache_kind.startswith("indexer"):
        dim = _rand_choice(g, p["dims"])
        cache = _garbage_like(new_indexer_k_cache(num_pages, page, dim, fp8=fp8, device="cpu"), g)
        k = _rand_rows(g, tokens, dim)
        want = write_indexer_k_reference(k, cache.clone(), slots)
        got = write_indexer_k(k.to(dev), cache.to(dev), slots.to(dev))
    else:
        model1 = cache_kind.startswith("model1")  # DeepSeek-V4's formats: 448 + 64 values
        dim, nope = (512, 448) if model1 else (576, 512)
        fmt = cache_kind.removeprefix("mla_")
        cache = _garbage_like(new_mla_cache(num_pages, page, format=fmt, device="cpu"), g)
        kv = _rand_rows(g, tokens, dim)
        ref = write_model1_latent_reference if model1 else write_mla_latent_reference
        want = ref(kv[:, :nope], kv[:, nope:], cache.clone(), slots)
        got = write_mla_latent(
            kv[:, :nope].to(dev), kv[:, nope:].to(dev), cache.to(dev), slots.to(dev)
        )
    a, b = _bits(got.cpu()), _bits(want)
    if not torch.equal(a, b):
        diff = (a != b).reshape(num_pages * page, -1).any(dim=1).nonzero().flatten().tolist()
        return (
            f"tokens={tokens} dim={dim} slots {slots.dtype}: {len(diff)} cache rows differ, "
            f"first (page, offset) {divmod(diff[0], page)}"
        )
    return None


# ---- indexer logits --------------------------------------------------------------------------


def _run_logits(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    n, fp8, heads, dim, page = p["n"], p["fp8"], p["heads"], p["dim"], p["page"]
    num_req = _rand_int(g, 1, p["max_req"])
    width = _rand_int(g, 1, p["max_width"])
    pages = num_req * width + 3
    integer = _rand_int(g, 0, 3) == 0  # every step exact: compared bit for bit
    if integer:
        keys = torch.randint(-3, 4, (pages * page, dim), generator=g).bfloat16()
        q = torch.randint(-3, 4, (num_req * n, heads, dim), generator=g).float()
        w = torch.randint(-4, 5, (num_req * n, heads), generator=g).float()
    else:
        keys = torch.randn(pages * page, dim, generator=g) * 10.0 ** _rand_int(g, -2, 2)
        keys = keys.bfloat16()
        q = torch.randn(num_req * n, heads, dim, generator=g)
        w = torch.randn(num_req * n, heads, generator=g) * (heads * dim) ** -0.5
    q = q.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    cache = new_indexer_k_cache(pages, page, dim, fp8=fp8, device="cpu")
    write_indexer_k_reference(keys, cache, torch.arange(pages * page))
    bt = torch.randperm(pages, generator=g)[: num_req * width].view(num_req, width).int()
    if _rand_int(g, 0, 2) == 0:  # invalid page ids: their positions score -inf
        bt.view(-1)[_rand_int(g, 0, bt.numel() - 1)] = _rand_choice(g, (-1, pages + 5))
    cap = width * page
    lens = torch.randint(0, cap + 1, (num_req,), generator=g)
    lens[_rand_int(g, 0, num_req - 1)] = _rand_choice(g, (cap, 0, -5, cap + 100, 2**31 - 1))
    lens = lens.int()
    max_len = _rand_choice(g, (cap, cap, _rand_int(g, 1, cap), cap + 17))

    ref = index_logits_reference(q, w, cache, lens, bt, next_n=n, max_len=max_len)
    mag = index_logits_reference(q, w, cache, lens, bt, next_n=n, max_len=max_len, magnitude=True)
    tol = dict(heads=heads, dim=dim, fp8=fp8, exact=integer, device=dev)
    qd, wd, cd, ld, btd = _to(dev, q, w, cache, lens, bt)
    rows = num_req * n
    out = torch.full((rows, max_len), float(POISON), device=dev)
    native = index_logits(qd, wd, cd, ld, btd, next_n=n, max_len=max_len, out=out)
    err = logits_error(native.cpu(), ref, mag, **tol)
    if err:
        return f"native B={num_req} W={width} max_len={max_len}: {err}"
    # Flattened: one single-token row per query token, the request's block-table row copied.
    j = torch.arange(n)
    flat_lens = (lens.long()[:, None] - n + 1 + j).clamp(0, 2**31 - 1).flatten().int()
    flat_bt = bt.repeat_interleave(n, dim=0)
    flat = index_logits(qd, wd, cd, flat_lens.to(dev), flat_bt.to(dev), max_len=max_len)
    err = logits_error(flat.cpu(), ref, mag, **tol)
    if err:
        return f"flattened B={num_req} W={width} max_len={max_len}: {err}"
    # The 2-D [B, n] lengths of the native form.
    two_d = index_logits(qd, wd, cd, flat_lens.view(num_req, n).to(dev), btd, max_len=max_len)
    err = logits_error(two_d.cpu(), ref, mag, **tol)
    if err:
        return f"2-D lengths B={num_req} W={width} max_len={max_len}: {err}"
    # Native vs flattened: the same -inf pattern, and within twice the tolerance.
    err = logits_error(native.cpu(), flat.cpu().double(), mag, slack=2, **tol)
    if err:
        return f"native vs flattened B={num_req} W={width}: {err}"
    return None


# ---- sparse MLA decode attention -------------------------------------------------------------

ATTN_HEADS = (1, 8, 16, 20, 32, 64, 128)


def _attention_cases(quick: bool) -> list[tuple[Case, bool]]:
    """Both cache formats x head counts x 4 repetitions (quick: interpreter sizes, one
    repetition of a few head counts); each case draws its shape and options from its seed."""
    out = []
    for rep, fp8, heads in itertools.product(range(4), (False, True), ATTN_HEADS):
        params = dict(fp8=fp8, heads=heads, quick=quick)
        out.append((Case("attention", 0, params), rep == 0 and heads in (1, 16, 20, 128)))
    # DeepSeek-V4's MODEL1 rows (512 wide, K = V), both formats.
    for rep, fp8, heads in itertools.product(range(2), (False, True), (16, 20, 128)):
        params = dict(fp8=fp8, heads=heads, quick=quick, model1=True)
        out.append((Case("attention", 0, params), rep == 0 and heads in (16, 20)))
    return out


def _second_set(g: torch.Generator, tokens: int, fp8: bool) -> dict:
    """A second index set (DeepSeek-V4's compressed entries) of a MODEL1 call: its own cache
    (another page size), ids with hostile values, maybe valid counts."""
    from .testing import random_attention_indices

    page2, pages2, topk2 = (
        _rand_choice(g, (2, 8, 64)),
        _rand_int(g, 1, 4),
        _rand_choice(g, (16, 64, 100)),
    )
    rows2 = pages2 * page2
    idx2 = random_attention_indices(g, tokens, topk2, rows2,
                                    invalid_frac=_rand_choice(g, (0.0, 0.3)))  # fmt: skip
    idx2[torch.rand(tokens, topk2, generator=g) < 0.05] = _rand_choice(g, (rows2, -5, 2**31 - 1))
    kw = {"extra_kv_cache": _model1_cache(pages2, page2, fp8, g), "extra_indices": idx2}
    if _rand_int(g, 0, 1):
        kw["extra_topk_length"] = torch.randint(-2, topk2 + 3, (tokens,), generator=g,
                                                dtype=torch.int32)  # fmt: skip
    return kw


def _model1_cache(pages: int, page: int, fp8: bool, g: torch.Generator) -> torch.Tensor:
    """A MODEL1 cache of random rows (64-value groups of magnitudes 2**-10 .. 2**4)."""
    from .ops.kv_cache.naive import write_model1_latent_reference

    n = pages * page
    mag = torch.exp2(torch.randint(-10, 5, (n, 8), generator=g).float()).repeat_interleave(64, 1)
    kv = (torch.randn(n, 512, generator=g) * mag).bfloat16()
    cache = new_mla_cache(pages, page, format="model1_fp8" if fp8 else "model1_bf16")
    return write_model1_latent_reference(kv[:, :448], kv[:, 448:], cache, torch.arange(n))


def _run_attention(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    """Random T, topk, page size, invalid entries, hostile slots, valid counts, sink, fused
    remap and forced splits against the fp64 reference (sparse_mla.testing's tolerance);
    the fused call must equal remap-then-attend bit for bit. Where the Hopper Gluon kernel
    runs, half the forced launch shapes force it instead."""
    from .ops.attention import AttentionConfig, sparse_mla_decode, sparse_mla_decode_reference
    from .ops.attention.attention import sm90_available
    from .testing import attention_error, random_attention_indices, random_mla_cache

    p = case.params
    quick, heads = p["quick"], p["heads"]
    page = _rand_choice(g, (16, 64))
    pages = _rand_int(g, 2, 6) if quick else _rand_int(g, 16, 64)
    tokens = _rand_int(g, 1, 3 if quick else 48)
    topk = _rand_choice(g, (64, 100, 128) if quick else (512, 1000, 2048))
    model1 = p.get("model1", False)
    if model1:
        cache = _model1_cache(pages, page, p["fp8"], g)
    else:
        cache = random_mla_cache(pages, page, fp8=p["fp8"], g=g,
                                 arbitrary_scales=_rand_int(g, 0, 1))  # fmt: skip
    rows = pages * page
    q = torch.randn(tokens, heads, 512 if model1 else 576, generator=g)
    q = q * _rand_choice(g, (0.3, 1.0, 8.0))
    q = q.bfloat16()
    idx = random_attention_indices(
        g, tokens, topk, rows, invalid_tail=_rand_int(g, 0, topk // 4),
        invalid_frac=_rand_choice(g, (0.0, 0.1, 0.9)),
    )  # fmt: skip
    hostile = torch.rand(tokens, topk, generator=g) < 0.05
    idx[hostile] = _rand_choice(g, (rows, -3, 2**31 - 1))
    kw: dict = {}
    if _rand_int(g, 0, 1):
        kw["topk_length"] = torch.randint(-2, topk + 3, (tokens,), generator=g, dtype=torch.int32)
    if _rand_int(g, 0, 2) == 0:
        kw["attn_sink"] = torch.randn(heads, generator=g) * 3
    # V4's second set, compressed entries (the quick sweep: with 20 heads, not 16; else 3 in 4)
    if model1 and (heads == 20 if quick else _rand_int(g, 0, 3) > 0):
        kw.update(_second_set(g, tokens, p["fp8"]))
    cfg = None
    if _rand_int(g, 0, 1):
        cfg = AttentionConfig(
            block_h=min(64, max(16, 1 << (heads - 1).bit_length())),
            block_n=_rand_choice(g, (16, 32, 64)),
            num_splits=_rand_int(g, 1, 8),
            num_warps=_rand_choice(g, (4, 8)),
            combine_heads=_rand_choice(g, (1, 4, 8)),
            num_stages=_rand_int(g, 1, 2),
        )
        if cfg.num_warps == 8 and sm90_available(dev) and not model1:  # (no extra draw)
            block_h = 64 if heads > 32 else 16 if p["fp8"] or heads <= 16 else 32
            cfg = AttentionConfig(
                block_h=block_h,
                block_n=64,
                num_splits=cfg.num_splits,
                num_warps=8 if block_h == 64 else 4,
                kernel="sm90",
            )
    ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=0.1352, magnitude=True, **kw)
    dkw = {k: v.to(dev) for k, v in kw.items()}
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((tokens, heads), float("nan"), device=dev)
    qd, cd, idd = _to(dev, q, cache, idx)
    sparse_mla_decode(qd, cd, idd, sm_scale=0.1352, out=out, lse=lse, config=cfg, **dkw)
    label = f"T={tokens} topk={topk} page={page} cfg={cfg} {sorted(kw)}"
    err = attention_error(out, lse, *ref)
    if err:
        return f"{label}: {err}"
    # Fused remap: request-local positions through a hostile block table.
    width, num_req = cdiv(rows, page) + 1, _rand_int(g, 1, 3)
    bt = torch.randint(-1, pages + 2, (num_req, width), generator=g, dtype=torch.int32)
    req = torch.randint(-1, num_req + 1, (tokens,), generator=g, dtype=torch.int32)
    pos = torch.randint(-2, width * page + 5, (tokens, topk), generator=g, dtype=torch.int32)
    slots = convert_req_index_to_global_index_reference(req, bt, pos, block_size=page)
    two_kw = fused_kw = dkw
    if "extra_indices" in kw:  # the second set's positions through its own block table
        cache2, topk2 = kw["extra_kv_cache"], kw["extra_indices"].shape[1]
        page2 = cache2.shape[1]
        width2 = cache2.shape[0] + 1  # one column past the pages
        bt2 = torch.randint(-1, cache2.shape[0] + 2, (num_req + 1, width2), generator=g,
                            dtype=torch.int32)  # fmt: skip
        pos2 = torch.randint(-2, width2 * page2 + 5, (tokens, topk2), generator=g,
                             dtype=torch.int32)  # fmt: skip
        slots2 = convert_req_index_to_global_index_reference(req, bt2, pos2, block_size=page2)
        two_kw = {**dkw, "extra_indices": slots2.to(dev)}
        fused_kw = {**dkw, "extra_indices": pos2.to(dev), "extra_block_table": bt2.to(dev)}
    two = sparse_mla_decode(qd, cd, slots.to(dev), sm_scale=0.1352, config=cfg, **two_kw)
    fused = sparse_mla_decode(
        qd, cd, pos.to(dev), sm_scale=0.1352, block_table=bt.to(dev), req_id=req.to(dev),
        block_size=page, config=cfg, **fused_kw,
    )  # fmt: skip
    return _compare(f"{label} fused out", fused[0].cpu(), two[0].cpu()) or _compare(
        f"{label} fused lse", fused[1].cpu(), two[1].cpu()
    )


def _compare(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    return None if torch.equal(got, want) else f"{what}: {_first_diff(got, want)}"


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    where = (got != want).nonzero()
    if len(where) == 0:  # equal values, different bits (NaN, -0.0)
        return "values differ only in NaN/-0.0 bits"
    at = tuple(where[0].tolist())
    return f"{len(where)} mismatches, first at {at}: got {got[at].item()} want {want[at].item()}"


RUNNERS = {
    "remap": _run_remap,
    "dcp": _run_dcp,
    "expand": _run_expand,
    "topk": _run_topk,
    "kvcache": _run_kvcache,
    "logits": _run_logits,
    "attention": _run_attention,
    "decode_step": lambda case, g, dev: check_random_step(case.seed, dev),
}
# Rough relative cost of one case, for scheduling across worker processes.
_COST = {"remap": 1, "dcp": 1, "expand": 1, "kvcache": 2, "topk": 4, "logits": 8, "attention": 8,
         "decode_step": 8}  # fmt: skip


def run_case(case: Case, dev: torch.device) -> str | None:
    """None when the case passes, else what went wrong (a crash is a failure of the case)."""
    g = torch.Generator().manual_seed(case.seed)
    try:
        return RUNNERS[case.kind](case, g, dev)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"


def _init_worker(threads: int) -> None:
    # Several workers share the cores: the CPU references should not oversubscribe them.
    torch.set_num_threads(threads)


def _run_chunk(cases: list[Case]) -> list[tuple[Case, str | None]]:
    dev = default_device()
    return [(c, run_case(c, dev)) for c in cases]


def _chunks(cases: list[Case], budget: int = 8) -> list[list[Case]]:
    """Consecutive cases grouped up to ``budget`` cost units, the most expensive kinds first
    (so no long case starts last and leaves the other workers idle)."""
    order = sorted(cases, key=lambda c: -_COST[c.kind])  # stable: seeds stay in order
    chunks: list[list[Case]] = []
    cost = budget
    for c in order:
        if cost + _COST[c.kind] > budget:
            chunks.append([])
            cost = 0
        chunks[-1].append(c)
        cost += _COST[c.kind]
    return chunks


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _results(cases: list[Case], jobs: int) -> Iterator[tuple[Case, str | None]]:
    """Run the cases, in ``jobs`` processes when > 1 (kernel compilation dominates a sweep on
    the GPU, and the processes compile different variants side by side)."""
    if jobs <= 1:
        dev = default_device()
        for c in cases:
            yield c, run_case(c, dev)
        return
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, _cpu_count() // jobs)
    with ProcessPoolExecutor(
        jobs, mp_context=ctx, initializer=_init_worker, initargs=(threads,)
    ) as pool:
        for done in pool.map(_run_chunk, _chunks(cases)):
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


def _group(case: Case) -> tuple[str, tuple, str]:
    """(kind, sort key, label) of the summary row a case is counted in."""
    p = case.params
    if case.kind in ("remap", "dcp", "topk"):
        return case.kind, (p["k"],), f"k={p['k']}"
    if case.kind == "expand":
        return case.kind, (p["n"],), f"n={p['n']}"
    if case.kind == "kvcache":
        return case.kind, (KV_CACHES.index(p["cache"]),), p["cache"]
    if case.kind == "logits":
        cache = "fp8" if p["fp8"] else "bf16"
        return case.kind, (p["fp8"], p["n"]), f"{cache} n={p['n']}"
    return case.kind, (), ""


def _summary(passed: Counter, failed: Counter, labels: dict) -> list[str]:
    """The summary table: one row per group, a total row per kind."""
    lines = [f"{'kind':8} {'group':14} {'passed':>7} {'failed':>7}"]
    keys = sorted(set(passed) | set(failed))
    for kind in sorted({k[0] for k in keys}):
        mine = [k for k in keys if k[0] == kind]
        for key in mine:
            lines.append(f"{kind:8} {labels[key]:14} {passed[key]:>7} {failed[key]:>7}")
        p = sum(passed[k] for k in mine)
        f = sum(failed[k] for k in mine)
        lines.append(f"{kind:8} {'(all)':14} {p:>7} {f:>7}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sparse-mla verify", description=__doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a few hundred small configurations (for the CPU interpreter)",
    )
    ap.add_argument("--seed", type=int, default=0, help="base seed of the sweep")
    ap.add_argument("--case", type=int, default=None, help="rerun only the case with this seed")
    ap.add_argument(
        "--kind",
        action="append",
        choices=sorted(RUNNERS),
        help="only cases of this kind (repeatable)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none when not a terminal)"
    )
    args = ap.parse_args(argv)
    progress = not args.no_progress and sys.stderr.isatty()

    dev = default_device()
    cases = build_cases(args.quick, args.seed)
    if args.case is not None:
        cases = [c for c in cases if c.seed == args.case]
        if not cases:
            print(f"no case with seed {args.case}", file=sys.stderr)
            return 2
    if args.kind:
        cases = [c for c in cases if c.kind in args.kind]
    print(" ".join(f"{k}={v}" for k, v in info().items()))
    kinds = Counter(c.kind for c in cases)
    print(
        f"{len(cases)} configurations on {dev}: "
        + ", ".join(f"{kinds[k]} {k}" for k in RUNNERS if kinds[k])
    )

    passed: Counter = Counter()
    failed: Counter = Counter()
    labels: dict = {}
    failures: list[str] = []
    t0 = time.time()
    for i, (case, err) in enumerate(_results(cases, args.jobs)):
        kind, sort_key, label = _group(case)
        key = (kind, sort_key)
        labels[key] = label
        if err is None:
            passed[key] += 1
        else:
            failed[key] += 1
            failures.append(f"FAIL {case.label()}: {err}")
        if progress and (i % 10 == 0 or i == len(cases) - 1):
            _progress(i + 1, len(cases), sum(failed.values()), t0)
    if progress:
        sys.stderr.write("\n")

    print()
    for line in _summary(passed, failed, labels):
        print(line)
    total_failed = sum(failed.values())
    print(f"{sum(passed.values())} passed, {total_failed} failed in {time.time() - t0:.1f}s")
    for line in failures:
        print(line)
    if failures:
        quick = " --quick" if args.quick else ""
        print(f"reproduce one with: sparse-mla verify{quick} --seed {args.seed} --case SEED")
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
