"""The exact global top-k under decode context parallelism (DCP), over torch.distributed.

Every rank scores only the positions it owns (``local_logits`` column ``l`` = its ``l``-th
owned position). The global top-k of a row is found from one all_gather of ``k`` candidates
per rank:

1. ``select_topk`` on the local scores: the rank's local top-k, ascending local positions.
2. Pack (Triton): each candidate's score and its global position (``dcp_global``) into one
   int32 tensor ``[T, 2, k]`` (score bits, then positions; -1 = no candidate).
3. One all_gather (``all_gather_into_tensor``) of the packs: ``[W, T, 2, k]`` on every rank.
4. Merge by position (Triton): every rank's candidates are already ascending in global
   position (``dcp_global`` is increasing in the local position), so the W lists are merged
   into one ascending list per row: a candidate's place is the sum over ranks of how many of
   that rank's candidates lie below it (a binary search in each list). Scores follow their
   positions into ``merged_scores`` ``[T, W*k]``; ``merged_len`` counts the candidates.
5. ``select_topk`` on ``merged_scores`` with ``merged_len``: it ranks by (score descending,
   lowest column), and column order is global-position order, so this is the stable merge
   by (score descending, lowest global position), with the same NaN / -0.0 rules as the
   single-GPU call; it returns columns ascending = positions ascending.
6. Gather (Triton): columns -> global positions, -1 padding.

Why it is exact: let ``x`` be in the global top-k of a row and ``r`` its owner. Fewer than
``k`` positions of the whole row beat ``x`` (higher score, or equal score and lower global
position), so fewer than ``k`` of ``r``'s own positions do. On ``r`` the local ranking breaks
ties by the lowest local position, which is the lowest global position among ``r``'s
positions, so ``x`` is in ``r``'s local top-k and hence among the candidates. So the global
top-k is a subset of the candidates, which are a subset of the row, and the merge ranks the
candidates by the single-GPU rule: its k best are the row's k best, bit for bit (a row with at
most k visible positions has all of them among the candidates).

``mode="union"`` skips steps 3-6: each rank returns its own local top-k as global positions
(no collective). Approximate: the rank's result holds every position of the global top-k
that it owns, plus positions of its own that lose globally to other ranks' positions.

CUDA-graph safe with a :func:`global_topk_workspace` (all buffers pre-sized, no host sync;
NCCL collectives capture into graphs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import triton.language as tl

from .. import _runtime
from .._checks import check_int, check_output, check_same_device, check_shape, check_tensor
from .._custom_op import compiling, custom_op, run_eager
from .._runtime import cdiv, jit, next_pow2
from ..ops._common.dcp import dcp_global
from ..ops.topk import MAX_K, select_topk, supported_k, topk_workspace
from ._dist import all_gather_into, check_group

__all__ = [
    "GlobalTopkWorkspace",
    "global_topk",
    "global_topk_workspace",
    "local_topk_candidates",
    "merge_topk_candidates",
]

_POS_LIMIT = 2**31 - 1  # global positions must stay below it (the merge's "no candidate")
_PACK_BLOCK = 1024
_MERGE_BLOCK = 256
_MERGE_WARPS = 4


@dataclasses.dataclass(frozen=True)
class GlobalTopkWorkspace:
    """Pre-sized buffers of :func:`global_topk` for up to ``rows`` rows (one call at a time).

    Attributes:
        rows, k, dcp_size: what it was sized for.
        local: int32 ``[rows * k]``, the local top-k (local positions).
        send: int32 ``[rows * 2 * k]``, this rank's candidates (score bits, global positions).
        recv: int32 ``[dcp_size * rows * 2 * k]``, every rank's candidates.
        merged_scores: fp32 ``[rows * dcp_size * k]``, candidates' scores in position order.
        merged_pos: int32 ``[rows * dcp_size * k]``, their global positions.
        merged_len: int32 ``[rows]``, candidates per row.
        selected: int32 ``[rows * k]``, the merge's chosen columns.
        topk: int32 workspace of both ``select_topk`` calls.
    """

    rows: int
    k: int
    dcp_size: int
    local: torch.Tensor
    send: torch.Tensor
    recv: torch.Tensor
    merged_scores: torch.Tensor
    merged_pos: torch.Tensor
    merged_len: torch.Tensor
    selected: torch.Tensor
    topk: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """Its tensors in field order (how an op takes it: a ``Tensor[]``)."""
        return [getattr(self, name) for name in _WORKSPACE_TENSORS]

    @classmethod
    def from_tensors(
        cls, tensors: list[torch.Tensor], rows: int, k: int, dcp_size: int
    ) -> GlobalTopkWorkspace:
        """The workspace :meth:`tensors` came from."""
        return cls(rows, k, dcp_size, *tensors)


_WORKSPACE_TENSORS = tuple(
    f.name
    for f in dataclasses.fields(GlobalTopkWorkspace)
    if f.name not in ("rows", "k", "dcp_size")
)


def global_topk_workspace(
    rows: int, *, k: int, dcp_size: int, device: torch.device | str | None = None
) -> GlobalTopkWorkspace:
    """Buffers for :func:`global_topk` calls of up to ``rows`` rows with this ``k`` and
    ``dcp_size`` (allocate once, outside CUDA-graph capture; reusable by every later call)."""
    check_int("rows", rows, lo=0)
    check_int("dcp_size", dcp_size, lo=1)
    _check_k(k)
    dev = _runtime.default_device() if device is None else torch.device(device)
    n = max(rows, 1)

    def i32(numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.int32, device=dev)

    return GlobalTopkWorkspace(
        rows=rows,
        k=k,
        dcp_size=dcp_size,
        local=i32(n * k),
        send=i32(n * 2 * k),
        recv=i32(dcp_size * n * 2 * k),
        merged_scores=torch.empty(n * dcp_size * k, dtype=torch.float32, device=dev),
        merged_pos=i32(n * dcp_size * k),
        merged_len=i32(n),
        selected=i32(n * k),
        topk=topk_workspace(n, device=dev),
    )


@jit
def _pack_candidates_kernel(
    logits,
    s_lt,
    s_ln,
    n_local,
    local,
    pos_out,
    s_pt,
    s_pj,
    score_out,
    s_st,
    rank,
    DCP_SIZE,
    INTERLEAVE,
    K: tl.constexpr,
    SCORES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Local top-k of row t -> global positions (-1 kept), and with SCORES their fp32 score
    bits (0 where there is no candidate)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_k = j < K
    lpos = tl.load(local + t * K + j, mask=in_k, other=-1)
    valid = (lpos >= 0) & (lpos < n_local)  # our own select_topk output, checked anyway
    lpos = tl.where(valid, lpos, 0)
    g = dcp_global(lpos, rank, DCP_SIZE, INTERLEAVE)
    tl.store(pos_out + t * s_pt + j * s_pj, tl.where(valid, g, -1), mask=in_k)
    if SCORES:
        x = tl.load(logits + t * s_lt + lpos.to(tl.int64) * s_ln, mask=in_k & valid, other=0.0)
        tl.store(score_out + t * s_st + j, x.to(tl.int32, bitcast=True), mask=in_k)


@jit
def _count_below(list_pos, p, K: tl.constexpr, LOG: tl.constexpr):
    """Entries of an ascending list of K positions (-1 entries at its end, treated as larger
    than any position) that are < p, for each lane's p: binary lifting, LOG = log2 of the
    power of two >= K."""
    cnt = tl.zeros_like(p)
    for s in tl.static_range(LOG + 1):
        probe = cnt + (1 << (LOG - s))
        ok = (probe <= K) & (p > 0)  # nothing is below 0 (or below a lane's -1)
        v = tl.load(list_pos + probe - 1, mask=ok, other=-1)
        cnt = tl.where(ok & (v >= 0) & (v < p), probe, cnt)
    return cnt


@jit
def _merge_by_position_kernel(
    recv,
    merged_scores,
    merged_pos,
    merged_len,
    rows,
    DCP_SIZE: tl.constexpr,
    K: tl.constexpr,
    LOG: tl.constexpr,
    W_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (t, r, c): rank r's candidates [c * BLOCK, (c + 1) * BLOCK) of row t go to
    their place in the row's position-ordered list of all ranks' candidates.

    ``recv`` is int32 ``[DCP_SIZE, rows, 2, K]`` (score bits, ascending global positions, -1
    after them). Global positions are distinct across ranks, so places never collide.
    """
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    base = recv + (r * rows + t) * (2 * K)
    p = tl.load(base + K + j, mask=j < K, other=-1)
    valid = p >= 0
    place = j  # rank r's own entries below p: the ones before it
    for r2 in tl.static_range(DCP_SIZE):
        if r2 != r:
            place += _count_below(recv + (r2 * rows + t) * (2 * K) + K, p, K, LOG)
    s = tl.load(base + j, mask=valid, other=0)
    row = t * (DCP_SIZE * K)
    tl.store(merged_scores + row + place, s.to(tl.float32, bitcast=True), mask=valid)
    tl.store(merged_pos + row + place, p, mask=valid)
    if (r == 0) & (tl.program_id(2) == 0):
        ranks = tl.arange(0, W_P2)
        lists = recv + (tl.minimum(ranks, DCP_SIZE - 1) * rows + t) * (2 * K) + K
        every = tl.full([W_P2], 2**31 - 1, tl.int32)
        n = _count_below(lists, every, K, LOG)
        tl.store(merged_len + t, tl.sum(tl.where(ranks < DCP_SIZE, n, 0), axis=0))


@jit
def _gather_positions_kernel(
    selected, merged_pos, out, s_ot, s_oj, K: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[t, j] = merged_pos[t, selected[t, j]], -1 where no column was selected."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_k = j < K
    col = tl.load(selected + t * K + j, mask=in_k, other=-1)
    ok = (col >= 0) & (col < COLS)
    g = tl.load(merged_pos + t * COLS + col, mask=in_k & ok, other=-1)
    tl.store(out + t * s_ot + j * s_oj, tl.where(ok, g, -1), mask=in_k)


def _check_workspace(ws: object, rows: int, k: int, dcp_size: int, device: torch.device):
    if not isinstance(ws, GlobalTopkWorkspace):
        raise ValueError(
            f"workspace must come from global_topk_workspace(), got {type(ws).__name__}"
        )
    if ws.rows < rows or ws.k != k or ws.dcp_size != dcp_size:
        raise ValueError(
            f"workspace was sized for rows <= {ws.rows}, k={ws.k}, dcp_size={ws.dcp_size}; "
            f"this call has rows={rows}, k={k}, dcp_size={dcp_size}"
        )
    if ws.local.device != device:
        raise ValueError(f"workspace is on {ws.local.device}, the inputs on {device}")


def _check_dcp_layout(dcp_size: int, dcp_rank: int, interleave: int) -> None:
    check_int("dcp_size", dcp_size, lo=1)
    check_int("dcp_rank", dcp_rank, lo=0, hi=dcp_size - 1)
    check_int("interleave", interleave, lo=1)


def _check_k(k: object) -> None:
    if not supported_k(k):
        raise ValueError(f"k must be an int in [1, {MAX_K}], got {k!r}")


def local_topk_candidates(
    local_logits: torch.Tensor,
    local_seq_lens: torch.Tensor,
    *,
    k: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    workspace: GlobalTopkWorkspace | None = None,
    positions_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's candidates for the global top-k (steps 1-2 of the module notes; no
    collective): its local top-k as fp32 score bits and global positions.

    Args:
        local_logits, local_seq_lens, k, dcp_size, dcp_rank, interleave: as
            :func:`global_topk`.
        workspace: optional :func:`global_topk_workspace` (at least T rows, same k and
            dcp_size).
        positions_out: optional int32 ``[T, k]`` (any strides): then only the global
            positions are written there (the union mode) and it is returned.

    Returns:
        int32 ``[T, 2, k]`` (a view of ``workspace.send``): ``[t, 0, j]`` the fp32 bits of the
        score of candidate j, ``[t, 1, j]`` its global position, ascending, -1 after the
        ``min(k, local length)`` candidates (score bits 0 there).
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        rows = local_logits.shape[0]
        if workspace is None:
            workspace = global_topk_workspace(rows, k=k, dcp_size=dcp_size,
                                              device=local_logits.device)  # fmt: skip
        _local_topk_candidates_op(
            local_logits, local_seq_lens, k, dcp_size, dcp_rank, interleave,
            workspace.tensors(), workspace.rows, positions_out,
        )  # fmt: skip
        if positions_out is not None:
            return positions_out
        return workspace.send[: rows * 2 * k].view(rows, 2, k)
    _check_dcp_layout(dcp_size, dcp_rank, interleave)
    _check_k(k)
    check_tensor("local_logits", local_logits, dtype=torch.float32, ndim=2)
    rows, n_local = local_logits.shape
    check_tensor("local_seq_lens", local_seq_lens, dtype=torch.int32, ndim=1)
    check_shape("local_seq_lens", local_seq_lens, (rows,))
    if n_local * dcp_size >= _POS_LIMIT:
        raise ValueError(
            f"local_logits has {n_local} columns: global positions up to "
            f"{n_local} * dcp_size={dcp_size} must stay below 2**31 - 1"
        )
    if positions_out is not None:
        check_tensor("positions_out", positions_out, dtype=torch.int32, ndim=2)
        check_output("positions_out", positions_out, (rows, k))
    device = check_same_device(
        local_logits=local_logits, local_seq_lens=local_seq_lens, positions_out=positions_out
    )
    if workspace is None:
        workspace = global_topk_workspace(rows, k=k, dcp_size=dcp_size, device=device)
    _check_workspace(workspace, rows, k, dcp_size, device)

    local = workspace.local[: rows * k].view(rows, k)
    select_topk(local_logits, local_seq_lens, k=k, out=local, workspace=workspace.topk)
    send = workspace.send[: rows * 2 * k].view(rows, 2, k)
    pos_out = send[:, 1] if positions_out is None else positions_out
    if rows:
        _pack_candidates_kernel[(rows, cdiv(k, _PACK_BLOCK))](
            local_logits,
            *local_logits.stride(),
            n_local,
            local,
            pos_out,
            *pos_out.stride(),
            send,
            send.stride(0),
            dcp_rank,
            dcp_size,
            interleave,
            K=k,
            SCORES=positions_out is None,
            BLOCK=_PACK_BLOCK,
        )
    return send if positions_out is None else positions_out


def merge_topk_candidates(
    candidates: torch.Tensor,
    *,
    k: int,
    out: torch.Tensor | None = None,
    workspace: GlobalTopkWorkspace | None = None,
) -> torch.Tensor:
    """The stable merge of every rank's candidates (steps 4-6 of the module notes; no
    collective): the top k by (score descending, lowest global position), ascending.

    Args:
        candidates: contiguous int32 ``[W, T, 2, k]``, rank r's :func:`local_topk_candidates`
            at ``[r]`` (what the all_gather of :func:`global_topk` makes). Device data: lists
            that are not ascending, or positions on two ranks, give a wrong result but never
            an access out of bounds.
        k: positions per row (its last dimension).
        out: optional int32 ``[T, k]`` (any strides); every entry is written.
        workspace: optional :func:`global_topk_workspace` (at least T rows, same k and W).

    Returns:
        int32 ``[T, k]`` global positions, ascending, then -1.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        w, rows = candidates.shape[0], candidates.shape[1]
        if workspace is None:
            workspace = global_topk_workspace(rows, k=k, dcp_size=w, device=candidates.device)
        out = _empty_positions(rows, k, candidates.device) if out is None else out
        _merge_topk_candidates_op(candidates, k, out, workspace.tensors(), workspace.rows)
        return out
    _check_k(k)
    check_tensor("candidates", candidates, dtype=torch.int32, ndim=4)
    w, rows = candidates.shape[:2]
    check_shape("candidates", candidates, (w, rows, 2, k))
    if w < 1 or not candidates.is_contiguous():
        raise ValueError("candidates must be a contiguous [W >= 1, T, 2, k] tensor")
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2)
        check_output("out", out, (rows, k))
    device = check_same_device(candidates=candidates, out=out)
    if workspace is None:
        workspace = global_topk_workspace(rows, k=k, dcp_size=w, device=device)
    _check_workspace(workspace, rows, k, w, device)
    out = _empty_positions(rows, k, device) if out is None else out
    if rows == 0:
        return out

    cols = w * k
    merged_scores = workspace.merged_scores[: rows * cols].view(rows, cols)
    merged_len = workspace.merged_len[:rows]
    _merge_by_position_kernel[(rows, w, cdiv(k, _MERGE_BLOCK))](
        candidates,
        merged_scores,
        workspace.merged_pos,
        merged_len,
        rows,
        DCP_SIZE=w,
        K=k,
        LOG=next_pow2(k).bit_length() - 1,
        W_P2=next_pow2(w),
        BLOCK=_MERGE_BLOCK,
        num_warps=_MERGE_WARPS,
    )
    selected = workspace.selected[: rows * k].view(rows, k)
    select_topk(merged_scores, merged_len, k=k, out=selected, workspace=workspace.topk)
    _gather_positions_kernel[(rows, cdiv(k, _PACK_BLOCK))](
        selected, workspace.merged_pos, out, *out.stride(), K=k, COLS=cols, BLOCK=_PACK_BLOCK
    )
    return out


@custom_op(
    "local_topk_candidates",
    public=local_topk_candidates,
    mutates_args=("workspace", "positions_out"),
    represents={"workspace": ("workspace", "workspace_rows")},
)
def _local_topk_candidates_op(
    local_logits: torch.Tensor,
    local_seq_lens: torch.Tensor,
    k: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    workspace: list[torch.Tensor],
    workspace_rows: int,
    positions_out: torch.Tensor | None,
) -> None:
    ws = GlobalTopkWorkspace.from_tensors(workspace, workspace_rows, k, dcp_size)
    run_eager(
        local_topk_candidates, local_logits, local_seq_lens, k=k, dcp_size=dcp_size,
        dcp_rank=dcp_rank, interleave=interleave, workspace=ws, positions_out=positions_out,
    )  # fmt: skip


@custom_op(
    "merge_topk_candidates",
    public=merge_topk_candidates,
    mutates_args=("out", "workspace"),
    represents={"workspace": ("workspace", "workspace_rows")},
)
def _merge_topk_candidates_op(
    candidates: torch.Tensor,
    k: int,
    out: torch.Tensor,
    workspace: list[torch.Tensor],
    workspace_rows: int,
) -> None:
    ws = GlobalTopkWorkspace.from_tensors(workspace, workspace_rows, k, candidates.shape[0])
    run_eager(merge_topk_candidates, candidates, k=k, out=out, workspace=ws)


def _empty_positions(rows: int, k: int, device: torch.device) -> torch.Tensor:
    return torch.empty((rows, k), dtype=torch.int32, device=device)


def global_topk(
    local_logits: torch.Tensor,
    local_seq_lens: torch.Tensor,
    *,
    k: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    group: dist.ProcessGroup,
    mode: str = "exact",
    out: torch.Tensor | None = None,
    workspace: GlobalTopkWorkspace | None = None,
) -> torch.Tensor:
    """Global top-k positions of each row from the scores of one DCP rank's shard.

    Every rank of ``group`` calls it with its own shard; with ``mode="exact"`` every rank
    returns the same result, equal bit for bit to single-GPU ``select_topk`` over the full
    rows (ranking: higher score first, ``-0.0 == +0.0``, NaN below every number, ties to the
    lowest global position; output ascending, then -1; a row with at most k visible
    positions gives all of them). See the module notes for the method and why it is exact.

    Ownership: global position ``p`` belongs to rank ``(p // interleave) % dcp_size`` at local
    position ``(p // (dcp_size * interleave)) * interleave + p % interleave``.

    Args:
        local_logits: fp32 ``[T, N_local]`` (any strides): column ``l`` is this rank's ``l``-th
            owned position of the row. Columns at or past the row's local length are ignored.
        local_seq_lens: int32 ``[T]``, this rank's visible positions of each row
            (``dcp_local_count`` of the row's length; ``sparse_mla.dcp_local_seq_lens``);
            device data, clamped to ``[0, N_local]``. 0 for CUDA-graph padding rows.
        k: positions per row, 1 to ``MAX_K``; the same on every rank.
        dcp_size: ranks the cache is sharded over; must equal ``group``'s size.
        dcp_rank: this rank in ``[0, dcp_size)``; must equal its rank in ``group``.
        interleave: positions per interleave group (>= 1).
        group: the DCP process group (NCCL on GPUs, gloo on CPUs).
        mode: ``"exact"`` (one all_gather, the global top-k) or ``"union"`` (no collective:
            this rank's own local top-k as global positions; approximate, see module notes).
        out: optional int32 ``[T, k]`` (any strides); every entry is written.
        workspace: optional :func:`global_topk_workspace` for at least T rows (same k and
            dcp_size); allocated per call when omitted.

    Returns:
        int32 ``[T, k]`` global positions, ascending, then -1.

    Raises:
        ValueError / TypeError naming the argument, before any collective, on every rank
        that gets it (arguments that differ between ranks but look valid locally cannot be
        detected without a collective: the caller passes the same T, k and sizes on every
        rank).
    """
    check_group(group, dcp_size=dcp_size, dcp_rank=dcp_rank)
    if mode not in ("exact", "union"):
        raise ValueError(f"mode must be 'exact' or 'union', got {mode!r}")
    _check_k(k)
    check_tensor("local_logits", local_logits, dtype=torch.float32, ndim=2)
    rows = local_logits.shape[0]
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2)
        check_output("out", out, (rows, k))
    device = check_same_device(local_logits=local_logits, local_seq_lens=local_seq_lens, out=out)
    if workspace is None:
        workspace = global_topk_workspace(rows, k=k, dcp_size=dcp_size, device=device)
    _check_workspace(workspace, rows, k, dcp_size, device)
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=device)
    kw = dict(k=k, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave)
    # Every remaining check is in here, still before the collective.
    send = local_topk_candidates(
        local_logits,
        local_seq_lens,
        workspace=workspace,
        positions_out=out if mode == "union" else None,
        **kw,
    )
    if mode == "union":
        return out
    recv = workspace.recv[: dcp_size * rows * 2 * k]
    all_gather_into(recv, send.reshape(-1), group)
    return merge_topk_candidates(recv.view(dcp_size, rows, 2, k), k=k, out=out, workspace=workspace)
