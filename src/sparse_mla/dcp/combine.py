"""The exact merge of per-rank partial attention under DCP (log-sum-exp combine).

Each rank attends over the selected tokens it owns and holds (out_r, lse_r); the attention
over all of them is ``lse = logsumexp_r lse_r`` and ``out = sum_r exp(lse_r - lse) * out_r``.
One all_gather of the lse ``[W, T, H]``, a Triton kernel that computes the global lse and this
rank's weighted out (weight 0 where its lse is -inf, and a zero product, never 0 * NaN), then
a sum over ranks: ``all_reduce`` (every rank gets all heads) or ``reduce_scatter`` over heads
(rank r gets heads ``[r * H / W, (r + 1) * H / W)``), as vLLM's ``cp_lse_ag_out_rs``.

NaN propagates as in the attention (``sparse_mla_decode``): a NaN lse (a NaN or +inf score
in that rank's row) on any rank makes that (token, head)'s merged out and lse NaN; every
rank's weighted part of it is NaN, so both reductions give NaN there. -inf means the rank
saw nothing, and so does +inf (FlashMLA's and ``compat.flashmla``'s marker of an empty row);
a (token, head) no rank saw gives (0, -inf).
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
from ._dist import all_gather_into, check_group, reduce_scatter_into

__all__ = ["CombineWorkspace", "combine", "combine_workspace", "rescale_partial"]

_REDUCE = ("all_reduce", "reduce_scatter_heads")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_H = 16
_MAX_BLOCK_D = 128


@dataclasses.dataclass(frozen=True)
class CombineWorkspace:
    """Pre-sized buffers of :func:`combine` (one call at a time).

    Attributes:
        tokens, heads, dim, dcp_size, dtype, reduce: what it was sized for (``dtype``: the
            dtype the sum over ranks runs in).
        lse_all: fp32 ``[dcp_size * tokens * heads]``, every rank's lse.
        send: ``dtype`` ``[tokens * heads * dim]``, this rank's weighted out; heads-chunk
            major (``[W, T, H / W, D]``) for ``reduce_scatter_heads``. Empty for all_reduce,
            which sums in the output buffer itself.
    """

    tokens: int
    heads: int
    dim: int
    dcp_size: int
    dtype: torch.dtype
    reduce: str
    lse_all: torch.Tensor
    send: torch.Tensor


def combine_workspace(
    tokens: int,
    heads: int,
    dim: int,
    *,
    dcp_size: int,
    dtype: torch.dtype,
    reduce: str = "all_reduce",
    device: torch.device | str | None = None,
) -> CombineWorkspace:
    """Buffers for :func:`combine` calls with up to ``tokens`` rows of this shape; ``dtype``
    is the dtype of the result buffer (``out_buffer``'s, else ``out``'s)."""
    check_int("tokens", tokens, lo=0)
    check_int("heads", heads, lo=1)
    check_int("dim", dim, lo=1)
    check_int("dcp_size", dcp_size, lo=1)
    if reduce not in _REDUCE:
        raise ValueError(f"reduce must be one of {_REDUCE}, got {reduce!r}")
    dev = _runtime.default_device() if device is None else torch.device(device)
    n = max(tokens, 1)
    send = tokens * heads * dim if reduce == "reduce_scatter_heads" else 0
    return CombineWorkspace(
        tokens=tokens,
        heads=heads,
        dim=dim,
        dcp_size=dcp_size,
        dtype=dtype,
        reduce=reduce,
        lse_all=torch.empty(dcp_size * n * heads, dtype=torch.float32, device=dev),
        send=torch.empty(send, dtype=dtype, device=dev),
    )


@jit
def _lse_combine_kernel(
    lse_all,
    out,
    s_ot,
    s_oh,
    s_od,
    dest,
    lse_out,
    s_lt,
    s_lh,
    rank,
    tokens,
    heads,
    dim,
    heads_per_chunk,
    DCP_SIZE: tl.constexpr,
    W_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (t, head block, dim block): global lse of row t (written by dim block 0), and
    this rank's weighted out. A head with a NaN lse on any rank gets lse NaN and a NaN part
    (from every rank); -inf and +inf (empty) ranks weigh 0 (their out is not used).

    ``lse_all`` fp32 ``[DCP_SIZE, tokens, heads]``. ``dest`` (the sum's dtype) gets head h of
    row t at ``[h // heads_per_chunk, t, h % heads_per_chunk, :]`` of a
    ``[heads / heads_per_chunk, tokens, heads_per_chunk, dim]`` layout.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_h = h < heads
    r = tl.arange(0, W_P2)
    ld = lse_all + (r[:, None] * tokens + t) * heads + h[None, :]
    lse_r = tl.load(ld, mask=(r[:, None] < DCP_SIZE) & in_h[None, :], other=float("-inf"))
    # NaN (a NaN attention row): the head's merged (out, lse) is NaN. -inf, and FlashMLA's
    # +inf: the rank saw nothing (weight 0). Padding ranks and heads read -inf.
    nan_head = tl.max((lse_r != lse_r).to(tl.int32), axis=0) > 0
    finite = (lse_r == lse_r) & (lse_r != float("inf")) & (lse_r != float("-inf"))
    lse_r = tl.where(finite, lse_r, float("-inf"))
    m = tl.max(lse_r, axis=0)
    any_row = m != float("-inf")
    m0 = tl.where(any_row, m, 0.0)
    total = tl.sum(tl.where(finite, tl.exp(lse_r - m0[None, :]), 0.0), axis=0)
    lse = tl.where(any_row, m0 + tl.log(tl.where(any_row, total, 1.0)), 0.0)  # 0: unused
    if tl.program_id(2) == 0:
        lse_st = tl.where(nan_head, float("nan"), tl.where(any_row, lse, float("-inf")))
        tl.store(lse_out + t * s_lt + h * s_lh, lse_st, mask=in_h)

    mine = tl.load(lse_all + (rank * tokens + t) * heads + h, mask=in_h, other=float("-inf"))
    mine_ok = (mine == mine) & (mine != float("inf")) & (mine != float("-inf")) & any_row
    weight = tl.where(mine_ok, tl.exp(tl.where(mine_ok, mine, 0.0) - lse), 0.0)
    use = weight > 0
    chunk = h // heads_per_chunk
    dst_h = ((chunk * tokens + t) * heads_per_chunk + h % heads_per_chunk) * dim
    m2 = in_h[:, None] & (d[None, :] < dim)
    o = tl.load(out + t * s_ot + h[:, None] * s_oh + d[None, :] * s_od, mask=m2, other=0.0)
    val = tl.where(use[:, None], weight[:, None] * o.to(tl.float32), 0.0)
    val = tl.where(nan_head[:, None], float("nan"), val)  # every rank's part: the sum is NaN
    tl.store(dest + dst_h[:, None] + d[None, :], val.to(dest.dtype.element_ty), mask=m2)


def _check_workspace(ws: object, t: int, h: int, d: int, w: int, dtype, reduce, device):
    if not isinstance(ws, CombineWorkspace):
        raise ValueError(f"workspace must come from combine_workspace(), got {type(ws).__name__}")
    want = (h, d, w, dtype, reduce)
    got = (ws.heads, ws.dim, ws.dcp_size, ws.dtype, ws.reduce)
    if ws.tokens < t or got != want:
        raise ValueError(
            f"workspace was sized for tokens <= {ws.tokens}, (heads, dim, dcp_size, dtype, "
            f"reduce) = {got}; this call needs tokens={t}, {want}"
        )
    if ws.lse_all.device != device:
        raise ValueError(f"workspace is on {ws.lse_all.device}, the inputs on {device}")


def _check_partial(out: object, lse: object) -> tuple[int, int, int]:
    check_tensor("out", out, dtype=_OUT_DTYPES, ndim=3)
    t, h, d = out.shape
    check_tensor("lse", lse, dtype=torch.float32, ndim=2)
    check_shape("lse", lse, (t, h))
    return t, h, d


def _check_reduce(reduce: object, heads: int, w: int) -> bool:
    """Whether ``reduce`` splits heads (checked: one of _REDUCE, W divides H then)."""
    if reduce not in _REDUCE:
        raise ValueError(f"reduce must be one of {_REDUCE}, got {reduce!r}")
    scatter = reduce == "reduce_scatter_heads"
    if scatter and heads % w:
        raise ValueError(
            f"reduce_scatter_heads needs heads divisible by the group size: {heads} % {w}"
        )
    return scatter


def rescale_partial(
    out: torch.Tensor,
    lse_all: torch.Tensor,
    *,
    dcp_rank: int,
    reduce: str = "all_reduce",
    dest: torch.Tensor,
    lse_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local step of :func:`combine` (no collective): the global lse, and this rank's
    out weighted by ``exp(lse_r - lse)`` (0 where lse_r is -inf or +inf; never 0 * NaN).
    Where any rank's lse is NaN, the global lse and ``dest`` are NaN (on every rank).

    Args:
        out: ``[T, H, D]`` bf16, fp16 or fp32 (any strides), rank ``dcp_rank``'s attention.
        lse_all: contiguous fp32 ``[W, T, H]``, every rank's lse (-inf, or FlashMLA's +inf:
            the rank saw nothing; NaN: a NaN row, the (token, head) becomes NaN).
        dcp_rank: this rank, in ``[0, W)``.
        reduce: the layout of ``dest``: ``"all_reduce"``: ``[T, H, D]``;
            ``"reduce_scatter_heads"``: ``[W, T, H / W, D]`` (head chunk ``c`` at ``[c]``).
        dest: contiguous bf16, fp16 or fp32 tensor of ``T * H * D`` elements, that layout.
        lse_out: fp32 ``[T, H]`` (any strides), the global lse (-inf where no rank saw the
            head, NaN where a rank's lse is NaN).

    Returns:
        ``(dest, lse_out)``; summing ``dest`` over ranks gives the merged out.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        _rescale_partial_op(out, lse_all, dcp_rank, reduce, dest, lse_out)
        return dest, lse_out
    check_tensor("out", out, dtype=_OUT_DTYPES, ndim=3)
    t, h, d = out.shape
    check_tensor("lse_all", lse_all, dtype=torch.float32, ndim=3)
    w = lse_all.shape[0]
    check_shape("lse_all", lse_all, (w, t, h))
    if not lse_all.is_contiguous():
        raise ValueError("lse_all must be contiguous")
    check_int("dcp_rank", dcp_rank, lo=0, hi=w - 1)
    scatter = _check_reduce(reduce, h, w)
    check_tensor("dest", dest, dtype=_OUT_DTYPES)
    if dest.numel() != t * h * d or not dest.is_contiguous():
        raise ValueError(f"dest must be contiguous with {t * h * d} elements, got {dest.shape}")
    check_tensor("lse_out", lse_out, dtype=torch.float32, ndim=2)
    check_output("lse_out", lse_out, (t, h))
    check_same_device(out=out, lse_all=lse_all, dest=dest, lse_out=lse_out)
    block_d = min(next_pow2(d), _MAX_BLOCK_D)
    if t:
        _lse_combine_kernel[(t, cdiv(h, _BLOCK_H), cdiv(d, block_d))](
            lse_all,
            out,
            *out.stride(),
            dest,
            lse_out,
            *lse_out.stride(),
            dcp_rank,
            t,
            h,
            d,
            h // w if scatter else h,
            DCP_SIZE=w,
            W_P2=next_pow2(w),
            BLOCK_H=_BLOCK_H,
            BLOCK_D=block_d,
        )
    return dest, lse_out


@custom_op("rescale_partial", public=rescale_partial, mutates_args=("dest", "lse_out"))
def _rescale_partial_op(
    out: torch.Tensor,
    lse_all: torch.Tensor,
    dcp_rank: int,
    reduce: str,
    dest: torch.Tensor,
    lse_out: torch.Tensor,
) -> None:
    run_eager(
        rescale_partial, out, lse_all, dcp_rank=dcp_rank, reduce=reduce, dest=dest,
        lse_out=lse_out,
    )  # fmt: skip


def combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    reduce: str = "all_reduce",
    out_buffer: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: CombineWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every DCP rank's partial attention into the attention over all their tokens.

    Every rank of ``group`` calls it with its own partial result. Exact up to rounding:
    ``lse = logsumexp_r lse_r``, ``out = sum_r exp(lse_r - lse) * out_r``; a rank whose lse is
    -inf (it owns none of the row's tokens; +inf, FlashMLA's empty marker, reads the same)
    adds nothing, whatever its out holds (never 0 * NaN); a (token, head) no rank saw gives
    (0, -inf). NaN propagates as in the attention: a NaN lse on any rank (its attention of
    that row and head is NaN) gives out NaN and lse NaN for that (token, head), whatever the
    other ranks hold; the other heads and tokens are unaffected. A NaN in the out of a rank
    with a finite lse and a nonzero weight makes the merged out NaN too.
    The weighted parts are rounded to the result's dtype and summed in it by the collective
    (pass an fp32 ``out_buffer`` for an fp32 sum of bf16 parts).

    Args:
        out: ``[T, H, D]`` bf16, fp16 or fp32 (any strides), this rank's attention over its
            tokens.
        lse: fp32 ``[T, H]`` (any strides), natural-log sum of exp of this rank's scores
            (-inf: none; NaN: a NaN row, as ``sparse_mla_decode`` gives).
        group: the DCP process group; the same shapes and dtypes on every rank.
        reduce: ``"all_reduce"`` (every rank gets every head) or ``"reduce_scatter_heads"``
            (rank r gets heads ``[r * H / W, (r + 1) * H / W)``; W must divide H).
        out_buffer: optional contiguous result, ``[T, H, D]`` (all_reduce) or
            ``[T, H / W, D]`` (reduce_scatter_heads), bf16, fp16 or fp32 (default: out's dtype).
        lse_out: optional fp32 ``[T, H]`` (any strides) for the global lse.
        workspace: optional :func:`combine_workspace` (same H, D, W, result dtype and reduce,
            at least T tokens); allocated per call when omitted.

    Returns:
        ``(out, lse)``: the merged out (``out_buffer``) and the global lse fp32 ``[T, H]`` of
        every head on every rank (the same values on every rank; NaN as above).

    Raises:
        ValueError / TypeError naming the argument, before any collective.
    """
    w, rank = check_group(group)
    t, h, d = _check_partial(out, lse)
    scatter = _check_reduce(reduce, h, w)
    res_shape = (t, h // w, d) if scatter else (t, h, d)
    if out_buffer is not None:
        check_tensor("out_buffer", out_buffer, dtype=_OUT_DTYPES, ndim=3)
        check_output("out_buffer", out_buffer, res_shape)
        if not out_buffer.is_contiguous():
            raise ValueError("out_buffer must be contiguous (it is a collective's buffer)")
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtype=torch.float32, ndim=2)
        check_output("lse_out", lse_out, (t, h))
    device = check_same_device(out=out, lse=lse, out_buffer=out_buffer, lse_out=lse_out)
    dtype = out.dtype if out_buffer is None else out_buffer.dtype
    if workspace is None:
        workspace = combine_workspace(
            t, h, d, dcp_size=w, dtype=dtype, reduce=reduce, device=device
        )
    _check_workspace(workspace, t, h, d, w, dtype, reduce, device)
    if out_buffer is None:
        out_buffer = torch.empty(res_shape, dtype=dtype, device=device)
    if lse_out is None:
        lse_out = torch.empty((t, h), dtype=torch.float32, device=device)

    lse_all = workspace.lse_all[: w * t * h]
    # A collective needs a contiguous input (copied only when the caller's lse is a view).
    all_gather_into(lse_all, lse.contiguous().view(-1), group)
    dest = workspace.send[: t * h * d] if scatter else out_buffer
    rescale_partial(
        out, lse_all.view(w, t, h), dcp_rank=rank, reduce=reduce, dest=dest, lse_out=lse_out
    )
    if scatter:
        reduce_scatter_into(out_buffer.view(-1), dest, group)
    else:
        dist.all_reduce(out_buffer, group=group)
    return out_buffer, lse_out
