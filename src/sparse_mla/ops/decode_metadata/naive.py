"""Plain PyTorch references for decode-metadata expansion, written for clarity.

* :func:`expand_decode_tokens_reference` -- Python loops, the definition of the semantics;
* :func:`expand_decode_tokens_torch_ops` -- the vectorised PyTorch-ops path engines use in the
  ragged case (``repeat_interleave`` with a host-known size, ``index_select``): a baseline;
* :func:`native_decode_seq_lens_reference`, :func:`dcp_local_seq_lens_reference`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._common.dcp import dcp_owner_reference
from .expand import ExpandedDecodeTokens


def dcp_local_len(length: int, dcp_size: int, dcp_rank: int, interleave: int = 1) -> int:
    """Number of positions ``p < length`` owned by ``dcp_rank`` under ``ops/_common/dcp.py``'s
    rule, counted group by group (no loop over positions: lengths may be near 2**31).

    Positions form groups of ``interleave``; group ``g`` lives on rank ``g % dcp_size``: the
    complete groups below ``length`` this rank owns, plus the partial last one if it is its.
    """
    length = max(length, 0)
    groups, tail = divmod(length, interleave)
    owned_groups = max(0, -(-(groups - dcp_rank) // dcp_size))  # g < groups, g % W == rank
    last = dcp_owner_reference(torch.tensor(groups * interleave), dcp_size, interleave)
    return owned_groups * interleave + (tail if int(last) == dcp_rank else 0)


def _as_list(values: int | Sequence[int] | torch.Tensor, num_reqs: int) -> list[int]:
    if isinstance(values, int):
        return [values] * num_reqs
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def expand_decode_tokens_reference(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_lens: int | Sequence[int] | torch.Tensor,
    *,
    max_decode_len: int | None = None,
    num_tokens: int | None = None,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> ExpandedDecodeTokens:
    """Reference for :func:`sparse_mla.expand_decode_tokens`, one token at a time.

    Args:
        seq_lens: int ``[B]``, total length ``L_b`` per request (negatives read as 0).
        block_table: int ``[B, W]``, page ids per request.
        decode_lens: query tokens ``n_b`` per request: an int (all equal), a sequence or a
            tensor ``[B]``. Values are clamped to ``[0, max_decode_len]`` the way the kernel
            treats device data (to ``>= 0`` when ``max_decode_len`` is None).
        num_tokens: rows ``N`` to produce; default ``sum(n_b)``. Extra rows are padding
            (length 0, decode length 1, request 0, block-table row all 0); tokens past row
            ``N`` are dropped.
        dcp_size, dcp_rank, interleave: lengths localised to ``dcp_rank`` after expansion.

    Returns:
        :class:`ExpandedDecodeTokens` of int32 tensors on ``seq_lens.device``: ``seq_lens [N]``,
        ``block_table [N, W]``, ``decode_lens [N]``, ``req_id [N]``.
    """
    num_reqs, width = block_table.shape
    lens = [int(v) for v in seq_lens.tolist()]
    table = block_table.tolist()
    n_list = _as_list(decode_lens, num_reqs)
    rows_len: list[int] = []
    rows_bt: list[list[int]] = []
    rows_req: list[int] = []
    for b in range(num_reqs):
        n = max(n_list[b], 0)
        if max_decode_len is not None:
            n = min(n, max_decode_len)
        for j in range(n):
            # The j-th of the request's n query tokens sees every position before it.
            visible = max(max(lens[b], 0) - n + j + 1, 0)
            if dcp_size > 1:
                visible = dcp_local_len(visible, dcp_size, dcp_rank, interleave)
            rows_len.append(visible)
            rows_bt.append(list(table[b]))
            rows_req.append(b)
    if num_tokens is None:
        num_tokens = len(rows_len)
    # Truncate to num_tokens, then pad with harmless rows.
    rows_len, rows_bt, rows_req = rows_len[:num_tokens], rows_bt[:num_tokens], rows_req[:num_tokens]
    while len(rows_len) < num_tokens:
        rows_len.append(0)
        rows_bt.append([0] * width)
        rows_req.append(0)

    def t(data: list, *shape: int) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int32, device=seq_lens.device).reshape(shape)

    return ExpandedDecodeTokens(
        seq_lens=t(rows_len, num_tokens),
        block_table=t(rows_bt, num_tokens, width),
        decode_lens=t([1] * num_tokens, num_tokens),
        req_id=t(rows_req, num_tokens),
    )


def expand_decode_tokens_torch_ops(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_lens: Sequence[int] | torch.Tensor,
    *,
    total_tokens: int | None = None,
    num_tokens: int | None = None,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> ExpandedDecodeTokens:
    """Vectorised PyTorch-ops expansion (what engines run in the ragged case): a baseline.

    Args:
        seq_lens: int32 ``[B]`` on the device.
        block_table: int32 ``[B, W]`` on the device.
        decode_lens: ``n_b`` per request, ``>= 0``: a host sequence, or an int32 device tensor
            ``[B]`` together with ``total_tokens``.
        total_tokens: host-known ``sum(n_b)`` (required with a device ``decode_lens``; lets
            ``repeat_interleave`` size its output without a device-to-host sync).
        num_tokens: rows ``N >= total_tokens`` (padding rows as in the kernel); default total.
        dcp_size, dcp_rank, interleave: DCP localisation after expansion.

    Returns:
        :class:`ExpandedDecodeTokens` of int32 tensors, same semantics as the kernel.
    """
    device = seq_lens.device
    num_reqs, width = block_table.shape
    if isinstance(decode_lens, torch.Tensor) and decode_lens.device == device:
        if total_tokens is None:
            raise ValueError("total_tokens is required with device decode_lens")
        dl = decode_lens.to(torch.int32)
    else:
        host = _as_list(decode_lens, num_reqs)
        total_tokens = sum(host)
        dl = torch.tensor(host, dtype=torch.int32, device=device)
    if num_tokens is None:
        num_tokens = total_tokens

    req = torch.repeat_interleave(
        torch.arange(num_reqs, dtype=torch.int32, device=device), dl, output_size=total_tokens
    )
    starts = torch.cumsum(dl, 0, dtype=torch.int32) - dl
    j = torch.arange(total_tokens, dtype=torch.int32, device=device) - starts[req]
    lens = (seq_lens.clamp_min(0)[req] - dl[req] + j + 1).clamp_min(0)
    if dcp_size > 1:
        lens = dcp_local_seq_lens_reference(
            lens, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave
        )

    out = ExpandedDecodeTokens(
        seq_lens=torch.zeros(num_tokens, dtype=torch.int32, device=device),
        block_table=torch.zeros(num_tokens, width, dtype=torch.int32, device=device),
        decode_lens=torch.ones(num_tokens, dtype=torch.int32, device=device),
        req_id=torch.zeros(num_tokens, dtype=torch.int32, device=device),
    )
    out.seq_lens[:total_tokens] = lens
    out.block_table[:total_tokens] = block_table.index_select(0, req)
    out.req_id[:total_tokens] = req
    return out


def native_decode_seq_lens_reference(
    seq_lens: torch.Tensor,
    *,
    next_n: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> torch.Tensor:
    """Reference for :func:`native_decode_seq_lens`.

    Args:
        seq_lens: int ``[B]``, total length per request (negatives read as 0).
        next_n: query tokens per request.

    Returns:
        int32 ``[B, next_n]``: ``max(L_b - next_n + 1 + j, 0)``, DCP-localised when
        ``dcp_size > 1``.
    """
    rows = []
    for length in seq_lens.tolist():
        row = []
        for j in range(next_n):
            visible = max(max(int(length), 0) - next_n + 1 + j, 0)
            if dcp_size > 1:
                visible = dcp_local_len(visible, dcp_size, dcp_rank, interleave)
            row.append(visible)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32, device=seq_lens.device).reshape(-1, next_n)


def dcp_local_seq_lens_reference(
    seq_lens: torch.Tensor, *, dcp_size: int, dcp_rank: int, interleave: int = 1
) -> torch.Tensor:
    """:func:`sparse_mla.dcp_local_seq_lens` in vectorised PyTorch ops, the closed form engines
    use (the PyTorch-ops baseline; tests check it against :func:`dcp_local_len`).

    Args:
        seq_lens: int ``[N]`` global lengths (negatives read as 0).

    Returns:
        int32 ``[N]``: positions ``p < len`` with ``(p // interleave) % dcp_size == dcp_rank``.
    """
    length = seq_lens.to(torch.int64).clamp_min(0)
    span = dcp_size * interleave
    # Each full round of `span` positions gives this rank `interleave` of them.
    full = torch.div(length, span, rounding_mode="floor")
    rem = length - full * span
    part = (rem - dcp_rank * interleave).clamp(0, interleave)
    return (full * interleave + part).to(torch.int32)
