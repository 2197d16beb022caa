"""vLLM's sparse-MLA entry points under vLLM's names, positional order and keywords.

Drop-ins for what vLLM's DeepSeek-V3.2 path calls:

* ``vllm/v1/attention/backends/mla/sparse_utils.py``:
  :func:`triton_convert_req_index_to_global_index`, :func:`triton_filter_and_convert_dcp_index`;
* ``vllm/v1/attention/backends/utils.py``: :func:`get_dcp_local_seq_lens`;
* the top-k custom ops ``torch.ops._C.top_k_per_row_decode`` / ``top_k_per_row_prefill``:
  :func:`top_k_per_row_decode`, :func:`top_k_per_row_prefill` (they write ``indices``);
* the indexer metadata builder's ``_prepare_decode_tensors``: :func:`prepare_decode_tensors`.

Where vLLM asserts, these raise :class:`VllmAssertionError`, both an ``AssertionError`` (what
vLLM's callers and tests expect) and a ``ValueError`` (this library's convention), with
vLLM's assertion text in the message. Other bad input raises our usual ``ValueError`` /
``TypeError``. Differences, all towards safety: an out-of-range ``req_id`` gives a row of -1
instead of an out-of-bounds read; a negative page id or a slot past int32 gives -1 (not
counted); non-contiguous inputs are used in place; ``BLOCK_N`` is accepted and not needed
(any top-k width works); compaction is in column order (upstream: arbitrary order).

vLLM's names are kept here only: ``BLOCK_SIZE`` is our ``block_size``,
``cp_kv_cache_interleave_size`` our ``interleave``, ``NUM_TOPK_TOKENS`` the width of
``token_indices``.
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor
from ..ops.decode_metadata import (
    dcp_local_seq_lens,
    expand_decode_tokens,
    native_decode_seq_lens,
)
from ..ops.remap import (
    RemapConfig,
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)
from ..ops.topk import select_topk

# Scores the prefill top-k shifts per step (a gathered copy of whole rows, about 64 MiB).
_PREFILL_GATHER_ELEMS = 1 << 24


class VllmAssertionError(ValueError, AssertionError):
    """An input vLLM's own code rejects with ``assert``; the message contains vLLM's text."""


def _vllm_assert(ok: bool, text: str) -> None:
    if not ok:
        raise VllmAssertionError(text)


def _check_remap_args(
    req_id: torch.Tensor, block_table: torch.Tensor, token_indices: torch.Tensor, num_topk: int
) -> None:
    """The assertions both vLLM remap entry points make, in vLLM's words."""
    for name, t in (("req_id", req_id), ("block_table", block_table)):
        check_tensor(name, t)
        _vllm_assert(t.dtype == torch.int32, f"{name}.dtype == torch.int32 (got {t.dtype})")
    check_tensor("token_indices", token_indices, ndim=2)
    _vllm_assert(
        token_indices.dtype == torch.int32,
        f"token_indices.dtype == torch.int32 (got {token_indices.dtype})",
    )
    _vllm_assert(
        req_id.shape[0] == token_indices.shape[0],
        f"req_id ({req_id.shape[0]}) and token_indices ({token_indices.shape[0]}) must cover "
        "the same tokens",
    )
    _vllm_assert(
        token_indices.shape[1] == num_topk,
        f"token_indices.shape[1] == NUM_TOPK_TOKENS ({token_indices.shape[1]} != {num_topk})",
    )


def triton_convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    BLOCK_SIZE: int = 64,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    HAS_PREFILL_WORKSPACE: bool = False,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    *,
    BLOCK_STRIDE_ROWS: int | None = None,
    layout: str | RemapConfig = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM-compatible :func:`sparse_mla.convert_req_index_to_global_index`.

    vLLM's positional order (``NUM_TOPK_TOKENS`` fifth); ``BLOCK_STRIDE_ROWS`` (physical
    rows between pages, default ``BLOCK_SIZE``) is keyword-only, as every vLLM caller passes
    it, so a positional call meant for another order fails the ``NUM_TOPK_TOKENS`` check
    instead of remapping with a wrong page stride. ``BLOCK_N`` is ignored; ``layout`` (not
    vLLM's) is ``"auto"`` or a :class:`RemapConfig`, as in the library call.
    """
    _check_remap_args(req_id, block_table, token_indices, NUM_TOPK_TOKENS)
    if HAS_PREFILL_WORKSPACE:
        _vllm_assert(
            prefill_workspace_request_ids is not None,
            "prefill_workspace_request_ids is not None (HAS_PREFILL_WORKSPACE)",
        )
        _vllm_assert(
            prefill_workspace_starts is not None,
            "prefill_workspace_starts is not None (HAS_PREFILL_WORKSPACE)",
        )
        for name, t in (
            ("prefill_workspace_request_ids", prefill_workspace_request_ids),
            ("prefill_workspace_starts", prefill_workspace_starts),
        ):
            _vllm_assert(t.dtype == torch.int32, f"{name}.dtype == torch.int32 (got {t.dtype})")
    return convert_req_index_to_global_index(
        req_id,
        block_table,
        token_indices,
        block_size=BLOCK_SIZE,
        block_stride_rows=BLOCK_STRIDE_ROWS,
        prefill_request_ids=prefill_workspace_request_ids if HAS_PREFILL_WORKSPACE else None,
        prefill_workspace_starts=prefill_workspace_starts if HAS_PREFILL_WORKSPACE else None,
        return_valid_counts=return_valid_counts,
        layout=layout,
    )


def triton_filter_and_convert_dcp_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    cp_kv_cache_interleave_size: int = 1,
    BLOCK_SIZE: int = 64,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    return_valid_counts: bool = False,
    compact_valid_to_front: bool = True,
    *,
    BLOCK_STRIDE_ROWS: int | None = None,
    layout: str | RemapConfig = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM-compatible :func:`sparse_mla.filter_and_convert_dcp_index` (vLLM's order, and
    vLLM's ``BLOCK_STRIDE_ROWS`` keyword for caches whose pages interleave other layers')."""
    _vllm_assert(isinstance(dcp_size, int) and dcp_size >= 1, f"dcp_size >= 1 (got {dcp_size})")
    _vllm_assert(
        isinstance(dcp_rank, int) and 0 <= dcp_rank < dcp_size,
        f"0 <= dcp_rank < dcp_size (got dcp_rank={dcp_rank}, dcp_size={dcp_size})",
    )
    check_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size, lo=1)
    check_int("BLOCK_SIZE", BLOCK_SIZE, lo=1)
    _vllm_assert(
        BLOCK_SIZE % cp_kv_cache_interleave_size == 0,
        f"BLOCK_SIZE ({BLOCK_SIZE}) must be divisible by cp_kv_cache_interleave_size "
        f"({cp_kv_cache_interleave_size}).",
    )
    _check_remap_args(req_id, block_table, token_indices, NUM_TOPK_TOKENS)
    return filter_and_convert_dcp_index(
        req_id,
        block_table,
        token_indices,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=cp_kv_cache_interleave_size,
        block_size=BLOCK_SIZE,
        block_stride_rows=BLOCK_STRIDE_ROWS,
        compact=compact_valid_to_front,
        return_valid_counts=return_valid_counts,
        layout=layout,
    )


def get_dcp_local_seq_lens(
    seq_lens: torch.Tensor,
    dcp_size: int = 1,
    dcp_rank: int | None = None,
    cp_kv_cache_interleave_size: int = 1,
) -> torch.Tensor:
    """Positions of each length a DCP rank holds, in vLLM's calling convention.

    Args:
        seq_lens: integer lengths of any shape, ``[B]`` or the per-token ``[B, next_n]``
            (negatives read as 0).
        dcp_size, cp_kv_cache_interleave_size: the sharding (position ``p`` on rank
            ``(p // interleave) % dcp_size``).
        dcp_rank: this rank, or None for every rank.

    Returns:
        int32, ``seq_lens``' shape with ``dcp_rank``; with ``dcp_rank=None`` one more trailing
        dimension of ``dcp_size`` (``[B, dcp_size]`` for ``[B]``), as vLLM.
    """
    check_tensor("seq_lens", seq_lens)
    flat = seq_lens.to(torch.int32).reshape(-1)
    ranks = range(dcp_size) if dcp_rank is None else (dcp_rank,)
    if dcp_rank is None:
        check_int("dcp_size", dcp_size, lo=1)
    local = [
        dcp_local_seq_lens(
            flat, dcp_size=dcp_size, dcp_rank=r, interleave=cp_kv_cache_interleave_size
        ).view(seq_lens.shape)
        for r in ranks
    ]
    return local[0] if dcp_rank is not None else torch.stack(local, dim=-1)


def _logits_view(logits: torch.Tensor, num_rows: int, stride0: int, stride1: int) -> torch.Tensor:
    """The ``[num_rows, N]`` scores the op reads: ``logits``' own strides, or the ones given."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_int("num_rows", num_rows, lo=0, hi=logits.shape[0])
    if (stride0, stride1) == logits.stride():
        return logits[:num_rows]
    return logits.as_strided((num_rows, logits.shape[1]), (stride0, stride1))


def _indices_view(indices: torch.Tensor, num_rows: int, top_k: int | None) -> torch.Tensor:
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    k = indices.shape[1] if top_k is None else top_k
    _vllm_assert(
        indices.shape[0] >= num_rows and indices.shape[1] >= k,
        f"indices must hold [num_rows, topK] = [{num_rows}, {k}], got {tuple(indices.shape)}",
    )
    return indices[:num_rows, :k]


def top_k_per_row_decode(
    logits: torch.Tensor,
    next_n: int,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    num_rows: int,
    stride0: int,
    stride1: int,
    top_k: int | None = None,
) -> None:
    """``torch.ops._C.top_k_per_row_decode`` on :func:`sparse_mla.select_topk`: writes
    ``indices[:num_rows, :top_k]``.

    Row ``r`` sees ``seq_lens[r // next_n] - next_n + r % next_n + 1`` positions for a 1-D
    ``seq_lens`` ``[B]``, or ``seq_lens.flatten()[r]`` for the per-token ``[B, next_n]``
    form. Output: the selected positions (ascending; vLLM: any order), then -1 past the
    row's length. ``top_k`` (default: ``indices.shape[1]``) goes to ``select_topk`` as is.
    """
    view = _logits_view(logits, num_rows, stride0, stride1)
    out = _indices_view(indices, num_rows, top_k)
    check_tensor("seq_lens", seq_lens)
    lens = seq_lens.to(torch.int32)
    if lens.dim() == 1:
        check_int("next_n", next_n, lo=1)
        lens = native_decode_seq_lens(lens, next_n=next_n)
    rows = lens.reshape(-1)
    _vllm_assert(
        rows.shape[0] >= num_rows,
        f"seq_lens describes {rows.shape[0]} rows, fewer than num_rows ({num_rows})",
    )
    select_topk(view, rows[:num_rows].contiguous(), k=out.shape[1], out=out)


def top_k_per_row_prefill(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    indices: torch.Tensor,
    num_rows: int,
    stride0: int,
    stride1: int,
    top_k: int | None = None,
) -> None:
    """``torch.ops._C.top_k_per_row_prefill`` on :func:`sparse_mla.select_topk`: row ``r``
    ranks columns ``[row_starts[r], row_ends[r])`` and writes their offsets from
    ``row_starts[r]`` (then -1) into ``indices[r, :top_k]``.

    Rows whose window does not start at column 0 are shifted first: a gathered copy of at
    most ``2**24`` scores at a time (this one allocates; the decode op does not).
    """
    view = _logits_view(logits, num_rows, stride0, stride1)
    out = _indices_view(indices, num_rows, top_k)
    starts = check_tensor("row_starts", row_starts, ndim=1)[:num_rows].long()
    ends = check_tensor("row_ends", row_ends, ndim=1)[:num_rows].long()
    width = view.shape[1]
    lengths = (ends - starts).clamp(0, width).to(torch.int32)
    step = max(1, _PREFILL_GATHER_ELEMS // max(width, 1))
    cols = torch.arange(width, device=view.device)
    for r0 in range(0, num_rows, step):
        r1 = min(r0 + step, num_rows)
        src = (starts[r0:r1, None].clamp(0, width) + cols).clamp_max(max(width - 1, 0))
        shifted = view[r0:r1].gather(1, src) if width else view[r0:r1]
        select_topk(shifted, lengths[r0:r1], k=out.shape[1], out=out[r0:r1])


def prepare_decode_tensors(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_lens: torch.Tensor,
    decode_lens_cpu: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int,
    num_decode_tokens: int,
    use_native: bool,
    next_n: int,
    max_decode_len: int,
    global_seq_lens: torch.Tensor | None = None,
    *,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """The decode tensors vLLM's indexer metadata builder prepares (``_prepare_decode_tensors``),
    from :func:`sparse_mla.expand_decode_tokens` / :func:`sparse_mla.native_decode_seq_lens`.

    Args as vLLM's method (the builder's DCP settings as keywords): ``seq_lens`` int32 ``[B]``
    (DCP-local when ``global_seq_lens`` is given), ``block_table`` int32 ``[B, W]``,
    ``decode_lens`` int32 ``[B]`` on the device with its host copy ``decode_lens_cpu``;
    ``query_start_loc`` is accepted for the signature (rows follow from ``decode_lens_cpu``).
    With ``global_seq_lens`` and ``dcp_size > 1`` the per-token lengths are computed from
    the global lengths, then localised to ``dcp_rank``.

    Returns:
        ``(seq_lens, block_table, decode_lens, batch_size, requires_padding)``:

        * flattened (``not use_native and max_decode_len > 1``): one row per query token,
          ``seq_lens`` ``[N]``, ``block_table`` ``[N, W]``, ``decode_lens`` ``[N]`` all 1,
          ``batch_size = N`` (``num_decodes * max_decode_len`` when the lengths are uniform,
          else ``num_decode_tokens``; padding rows have length 0 and an all-zero table row),
          ``requires_padding`` False;
        * native MTP (``use_native and next_n > 1``): ``seq_lens`` ``[B, next_n]`` with
          ``L - next_n + 1 + j`` (clamped at 0), the inputs' ``block_table`` and
          ``decode_lens``, ``batch_size = B``, ``requires_padding`` when the decode lengths
          differ;
        * plain decode: the inputs, ``batch_size = B``, ``requires_padding`` likewise.
    """
    host = [int(v) for v in decode_lens_cpu[:num_decodes].tolist()]
    requires_padding = len(set(host)) > 1
    dcp = global_seq_lens is not None and dcp_size > 1
    lens = global_seq_lens[:num_decodes] if dcp else seq_lens[:num_decodes]
    dcp_kw = dict(
        dcp_size=dcp_size if dcp else 1,
        dcp_rank=dcp_rank if dcp else 0,
        interleave=cp_kv_cache_interleave_size if dcp else 1,
    )
    bt = block_table[:num_decodes]
    if not use_native and max_decode_len > 1:
        rows = num_decodes * max_decode_len if not requires_padding else num_decode_tokens
        out = expand_decode_tokens(
            lens, bt, host, max_decode_len=max_decode_len, num_tokens=rows, **dcp_kw
        )
        return out.seq_lens, out.block_table, out.decode_lens, rows, False
    if use_native and next_n > 1:
        seq_lens = native_decode_seq_lens(lens, next_n=next_n, **dcp_kw)
    return seq_lens, block_table, decode_lens, num_decodes, requires_padding
