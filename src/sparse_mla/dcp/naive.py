"""Plain PyTorch references for decode context parallelism (DCP), written to be read.

Everything here runs in one process and simulates the ``W`` ranks with a leading ``[W, ...]``
dimension; no collective is involved. These are the ground truth of the tests and the GPU
benchmark:

* :func:`merge_candidates_reference`: the stable merge of the all-gathered local top-k
  candidates (the Triton merge in :mod:`sparse_mla.dcp.topk`).
* :func:`global_topk_reference`: the whole exact method (local top-k on every rank, merge).
* :func:`combine_reference`: the exact (out, lse) merge of per-rank partial attention.
* :func:`attention_rows_reference`: attention of query heads over a list of cache rows,
  returning (out, lse) with empty rows (0, -inf). A stand-in for the attention op's own
  reference (``sparse_mla.ops.attention.naive``, on another branch) until it lands.

Ranking of scores, as :func:`sparse_mla.select_topk`: higher first, ``-0.0 == +0.0``, NaN
below every number, ties broken by the lowest (global) position.
"""

from __future__ import annotations

import torch

from ..ops._common.dcp import dcp_global_reference
from ..ops.topk.naive import select_topk_reference


def _rank_order(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Indices of ``scores`` (1-D) in rank order: score descending (NaN last, -0.0 == 0.0),
    then lowest position."""
    v = torch.where(scores == 0, torch.zeros_like(scores), scores)
    nan = torch.isnan(v)
    # Stable sorts from the least significant rule to the most significant one.
    order = torch.sort(positions, stable=True)[1]
    by_value = torch.where(nan, float("-inf"), v)[order]
    order = order[torch.sort(by_value, descending=True, stable=True)[1]]
    return order[torch.sort(nan[order].to(torch.int8), stable=True)[1]]


def merge_candidates_reference(
    scores: torch.Tensor, positions: torch.Tensor, k: int
) -> torch.Tensor:
    """Top k of every row's candidates from all ranks, as ascending global positions.

    Args:
        scores: fp32 ``[W, T, C]``, score of each candidate (rank, row, slot).
        positions: int32 ``[W, T, C]``, its global position; negative = no candidate (its
            score is ignored). Valid positions of one row are distinct.
        k: positions to keep per row.

    Returns:
        int32 ``[T, k]``: per row the ``min(k, candidates)`` best candidates by (score
        descending, position ascending), their positions sorted ascending, then -1.
    """
    w, rows, c = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for t in range(rows):
        s = scores[:, t].reshape(w * c).float().cpu()
        p = positions[:, t].reshape(w * c).long().cpu()
        valid = p >= 0
        s, p = s[valid], p[valid]
        best = p[_rank_order(s, p)[:k]]
        out[t, : best.numel()] = torch.sort(best)[0].to(torch.int32)
    return out


def local_topk_candidates_reference(
    local_logits: torch.Tensor,
    local_seq_lens: torch.Tensor,
    k: int,
    *,
    dcp_rank: int,
    dcp_size: int,
    interleave: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's candidates: its local top-k as (scores, global positions).

    Args:
        local_logits: fp32 ``[T, N_local]``, column ``l`` = this rank's ``l``-th owned position.
        local_seq_lens: int ``[T]``, this rank's visible local positions of each row.

    Returns:
        ``(scores fp32 [T, k], positions int32 [T, k])``: ascending global positions of the
        local top-k (-1 after them) and their scores (0 where the position is -1).
    """
    local = select_topk_reference(local_logits.cpu(), local_seq_lens.cpu(), k).long()
    valid = local >= 0
    scores = torch.where(valid, local_logits.cpu().gather(1, local.clamp_min(0)), 0.0)
    glob = dcp_global_reference(local.clamp_min(0), dcp_rank, dcp_size, interleave)
    return scores, torch.where(valid, glob, -1).to(torch.int32)


def global_topk_reference(
    local_logits: list[torch.Tensor],
    local_seq_lens: list[torch.Tensor],
    k: int,
    *,
    interleave: int,
) -> torch.Tensor:
    """The exact DCP top-k, all ranks simulated: every rank's local top-k, then the merge.

    Args:
        local_logits: one fp32 ``[T, N_r]`` per rank ``r`` (``W = len(local_logits)``).
        local_seq_lens: one int ``[T]`` per rank.

    Returns:
        int32 ``[T, k]`` global positions, ascending, -1 padded: equal to
        ``select_topk_reference`` over the full rows.
    """
    w = len(local_logits)
    cands = [
        local_topk_candidates_reference(x, n, k, dcp_rank=r, dcp_size=w, interleave=interleave)
        for r, (x, n) in enumerate(zip(local_logits, local_seq_lens, strict=True))
    ]
    scores = torch.stack([c[0] for c in cands])
    positions = torch.stack([c[1] for c in cands])
    return merge_candidates_reference(scores, positions, k)


def combine_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of per-rank partial attention (fp64 inside).

    Args:
        outs: ``[W, T, H, D]`` (any float dtype), rank ``r``'s attention over its shard.
        lses: fp32 ``[W, T, H]``, natural-log sum of exp of that rank's scores; -inf (or
            FlashMLA's +inf) where the rank saw no token (its out is then ignored, whatever it
            holds); NaN where the rank's attention of that (row, head) is NaN.

    Returns:
        ``(out fp32 [T, H, D], lse fp32 [T, H])``: ``lse = logsumexp_r lse_r``,
        ``out = sum_r exp(lse_r - lse) * out_r`` over the ranks with a finite lse; a (row,
        head) where any rank's lse is NaN gives (NaN, NaN), whatever the other ranks hold;
        rows no rank saw give (0, -inf).
    """
    lse64 = lses.double()
    nan_head = torch.isnan(lse64).any(0)  # [T, H]
    lse64 = torch.where(torch.isfinite(lse64), lse64, float("-inf"))
    lse = torch.logsumexp(lse64, dim=0)  # -inf where every rank has -inf
    weight = torch.exp(lse64 - lse)  # NaN where lse is -inf
    weight = torch.where(torch.isfinite(lse64) & torch.isfinite(lse), weight, 0.0)
    parts = torch.where(weight[..., None] > 0, weight[..., None] * outs.double(), 0.0)
    out = torch.where(nan_head[..., None], float("nan"), parts.sum(0))
    return out.float(), torch.where(nan_head, float("nan"), lse).float()


def attention_rows_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    sm_scale: float,
    v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its own list of cache rows, in fp32 (MLA style: V is the
    first ``v_dim`` columns of the key row).

    Args:
        q: ``[T, H, Dk]`` queries.
        kv: ``[S, Dk]`` cache rows (keys; values are ``kv[:, :v_dim]``).
        rows: int ``[T, K]``, cache rows each query attends to; negative = none.
        sm_scale: softmax scale applied to ``q . k``.

    Returns:
        ``(out fp32 [T, H, v_dim], lse fp32 [T, H])`` (natural log); a query with no row gives
        out 0 and lse -inf.
    """
    t_rows, heads, _ = q.shape
    out = torch.zeros(t_rows, heads, v_dim, dtype=torch.float32)
    lse = torch.full((t_rows, heads), float("-inf"), dtype=torch.float32)
    for t in range(t_rows):
        r = rows[t].long().cpu()
        r = r[r >= 0]
        if r.numel() == 0:
            continue
        keys = kv.cpu()[r].float()  # [n, Dk]
        s = sm_scale * (q[t].cpu().float() @ keys.T)  # [H, n]
        lse[t] = torch.logsumexp(s, dim=1)
        out[t] = torch.softmax(s, dim=1) @ keys[:, :v_dim]
    return out, lse
