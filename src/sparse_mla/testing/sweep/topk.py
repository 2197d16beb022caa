"""Random checks of the top-k: the kit's adversarial rows (``topk_scores``), lengths 0 / < k /
= k / > k / past N / negative, every path, and the fused slot epilogue against top-k then the
remap; bit for bit against ``select_topk_reference``."""

from __future__ import annotations

import torch

from ..._runtime import cdiv
from ...ops.remap import convert_req_index_to_global_index
from ...ops.topk import (
    TopKConfig,
    positions_to_slots_reference,
    select_topk,
    select_topk_reference,
    topk_workspace,
)
from ..checks import POISON
from ..topk_scores import topk_scores
from .draw import Case, compare, log_uniform_int, rand_choice, rand_int


def _topk_lengths(rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """int32 [rows]: the full row first, then 0, < k, = k, > k, past N, negative, random."""
    pool = [0, rand_int(g, 1, max(1, k - 1)), k, k + 1, n - 1, n + 7, -3]
    pool = [pool[i] for i in torch.randperm(len(pool), generator=g).tolist()]
    vals = [n] + pool + [rand_int(g, 0, n) for _ in range(rows)]
    return torch.tensor(vals[:rows], dtype=torch.int32)


def check_topk(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    """One top-k case, its prefilter (when it runs) marking the candidates or copying them
    out, drawn at random (the choice is otherwise by size)."""
    marked = rand_int(g, 0, 1) == 1
    config = TopKConfig(prefilter_mark_min_scores=0 if marked else 1 << 62)
    err = _check_topk_case(case, g, dev, config)
    return err and f"prefilter marks={marked} {err}"


def _check_topk_case(
    case: Case, g: torch.Generator, dev: torch.device, config: TopKConfig
) -> str | None:
    p = case.params
    k, mode = p["k"], p["mode"]
    rows = rand_int(g, 4, max(4, p["max_rows"]))
    num_splits: int | None = None
    if mode == "short":
        n = k if rand_int(g, 0, 2) == 0 else rand_int(g, 1, k)
        num_splits = rand_choice(g, (None, 1))
    else:
        lo = k + 1 if mode != "split" else max(k, config.split_block) + 1
        n = log_uniform_int(g, lo, max(lo, p["max_n"]))
        if mode == "row":
            num_splits = 1
        elif mode == "split":
            num_splits = rand_int(g, 2, min(32, cdiv(n, config.split_block)))
    prefilter = rand_choice(g, (None, True, False)) if mode == "split" else None
    x = topk_scores(p["dist"], rows, n, g, k=k)
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
    err = compare("positions", got.cpu(), want) or compare("counts", counts.cpu(), want_counts)
    if err:
        return f"n={n} rows={rows} num_splits={num_splits} prefilter={prefilter}: {err}"

    # Fused slot epilogue vs top-k then the remap (and vs the reference of both).
    bs = rand_choice(g, (64, 64, 16, 1))
    stride = rand_choice(g, (None, bs * rand_int(g, 2, 4)))
    num_req = rand_int(g, 1, 6)
    pages = cdiv(n, bs)
    width = rand_int(g, max(1, pages // 2), pages + 1)  # short tables: tails map to -1
    bt = torch.randint(0, 100_000, (num_req, width + 3), generator=g, dtype=torch.int32)
    bt = bt[:, :width]
    req = torch.randint(0, num_req, (rows,), generator=g, dtype=torch.int32)
    if rand_int(g, 0, 1):
        req[rand_int(g, 0, rows - 1)] = rand_choice(g, (-1, num_req))  # row outside [0, R)
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
        compare("fused slots vs two-step", fused.cpu(), two_step.cpu())
        or compare("fused counts vs two-step", fused_counts.cpu(), two_counts.cpu())
        or compare("fused slots vs reference", fused.cpu(), want_slots)
        or compare("fused counts vs reference", fused_counts.cpu(), want_slot_counts)
    )
    if err:
        return f"n={n} rows={rows} num_splits={num_splits} block_size={bs}: {err}"
    return None
