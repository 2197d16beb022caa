"""The decode-metadata entries: expansion to one row per token, native ``[B, n]`` lengths,
DCP-local lengths; each also a custom op (``torch.ops.sparse_mla.<name>``)."""

from __future__ import annotations

from itertools import accumulate

import torch

from ..._checks import (
    check_dcp,
    check_int,
    check_no_overlap,
    check_output,
    check_shape,
    check_tensor,
)
from ..._custom_op import compiling, custom_op, decode_config, encode_config, run_eager
from .config import ExpandConfig, check_expand_config
from .expand import (
    _INT32_MAX,
    MAX_DECODE_LEN,
    MAX_NEXT_N,
    MAX_REQUESTS_RAGGED,
    DecodeLens,
    ExpandedDecodeTokens,
    _check_expanded_out,
    _check_out_1d,
    _check_seq_lens_block_table,
    _empty_expanded,
    _host_decode_lens,
    _launch_dcp_local,
    _launch_expand,
    _launch_native,
    _to_device,
)


def expand_decode_tokens(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_lens: DecodeLens | None = None,
    *,
    max_decode_len: int,
    num_tokens: int | None = None,
    uniform: bool | None = None,
    query_start_loc: torch.Tensor | None = None,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out: ExpandedDecodeTokens | None = None,
    config: ExpandConfig | None = None,
    enable_pdl: bool | None = None,
) -> ExpandedDecodeTokens:
    """Flatten ``B`` decode requests into one single-query-token row per token (one launch).

    Args:
        seq_lens: int32 ``[B]`` on the kernel device, total length ``L_b`` of each request
            (including its ``n_b`` query tokens). Negative values are treated as 0.
        block_table: int32 ``[B, W]`` on the same device, each request's page ids; any strides
            (a row stride larger than ``W`` or a non-contiguous view is fine).
        decode_lens: number of query tokens ``n_b`` of each request, in one of three forms
            (or ``None`` with ``query_start_loc``):

            * a Python ``int``: every request has that many (uniform);
            * host-known: a sequence of ints or a CPU int32/int64 tensor ``[B]`` (when the
              kernel device is not the CPU). Checked: ``0 <= n_b <= max_decode_len``;
            * device data: an int32 tensor ``[B]`` on the kernel device (under the interpreter
              that is any CPU tensor). Never read on the host: the kernel clamps each value to
              ``[0, max_decode_len]``.
        max_decode_len: upper bound on ``n_b`` (>= 1).
        num_tokens: rows to write, ``N``. Defaults to ``sum(n_b)`` when host-known, else
            ``B * max_decode_len``. Rows past the real tokens are CUDA-graph padding: seq_len 0,
            decode_len 1, req_id 0 and the whole block-table row 0 (every column is written,
            where upstream zeroes only column 0, so the output is deterministic). Smaller than
            a host-known ``sum(n_b)`` is an error; with device ``decode_lens`` whose sum exceeds
            ``N`` the tokens past row ``N`` are simply not written.
        uniform: ``None`` picks the uniform kernel when ``decode_lens`` is host-known and all
            equal; ``True`` demands that; ``False`` forces the ragged kernel (host-known
            ``decode_lens`` then go to the device as offsets first, which allocates).
        query_start_loc: int32 ``[B + 1]`` on the kernel device, in place of ``decode_lens``:
            the first row of each request, as the cumulative query offsets engines keep
            (vLLM's ``query_start_loc``): ``n_b = q[b + 1] - q[b]``, rows of request ``b``
            from ``q[b] - q[0]`` (so a slice of a larger batch's offsets serves). The fastest
            ragged form: each program reads its two offsets instead of summing all ``B`` decode
            lengths. Device data, never read on the host; out of order values cannot write
            outside the ``N`` rows: the start ``s_b = q[b] - q[0]`` and the total
            ``q[B] - q[0]`` are clamped to ``[0, N]``, ``n_b = q[b + 1] - q[0] - s_b`` to
            ``[0, max_decode_len]``. Where requests' rows then overlap (each other, or the
            padding rows from the total on), each entry of such a row comes from one of
            them; rows none claims below the total are not written.
        dcp_size, dcp_rank, interleave: decode context parallelism. With ``dcp_size > 1``
            each per-token length is replaced, after expansion, by the number of positions
            ``p < len`` this rank owns, ``owner(p) = (p // interleave) % dcp_size``.
        out: optional pre-sized buffers with the shapes below (any strides); must not overlap
            the inputs. With ``out`` and device ``decode_lens`` or ``query_start_loc`` the call
            allocates nothing and does not synchronise (CUDA-graph safe).
        config: tuning (:class:`ExpandConfig`); None = the measured defaults.
        enable_pdl: programmatic dependent launch (the launch waits for the one before it,
            so its start overlaps that kernel's tail). None or True: on where the device
            supports it (Hopper on); False: off.

    Returns:
        :class:`ExpandedDecodeTokens` (``out`` itself when given): ``seq_lens`` int32 ``[N]``,
        ``block_table`` int32 ``[N, W]``, ``decode_lens`` int32 ``[N]`` (all 1), ``req_id`` int32
        ``[N]``. Example: ``L=[10, 7]``, ``n=3`` gives ``seq_lens=[8, 9, 10, 5, 6, 7]``.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        return _expand_through_op(
            seq_lens, block_table, decode_lens, max_decode_len, num_tokens, uniform,
            query_start_loc, dcp_size, dcp_rank, interleave, out, config, enable_pdl,
        )  # fmt: skip
    seq_lens, block_table, device = _check_seq_lens_block_table(seq_lens, block_table)
    config = check_expand_config(config)
    num_reqs, width = block_table.shape
    check_int("max_decode_len", max_decode_len, lo=1, hi=MAX_DECODE_LEN)
    check_dcp(dcp_size, dcp_rank, interleave)
    if uniform is not None and not isinstance(uniform, bool):
        raise TypeError(f"uniform must be None or a bool, got {type(uniform).__name__}")
    if (decode_lens is None) == (query_start_loc is None):
        raise ValueError("give exactly one of decode_lens and query_start_loc")

    # Classify decode_lens: host-known values, or device data.
    host: list[int] | None = None
    device_dl: torch.Tensor | None = None
    if query_start_loc is not None:
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=device)
        check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    elif isinstance(decode_lens, int) and not isinstance(decode_lens, bool):
        check_int("decode_lens", decode_lens, lo=0, hi=max_decode_len)
        host = [decode_lens] * num_reqs
    elif isinstance(decode_lens, torch.Tensor) and decode_lens.device == device:
        device_dl = check_tensor("decode_lens", decode_lens, dtype=torch.int32, ndim=1)
        check_shape("decode_lens", device_dl, (num_reqs,))
    elif isinstance(decode_lens, torch.Tensor) and decode_lens.device.type != "cpu":
        raise ValueError(
            f"decode_lens is on {decode_lens.device} but seq_lens is on {device}: pass it on "
            "the kernel device (device data) or on the CPU (host-known)"
        )
    else:
        host = _host_decode_lens(decode_lens, num_reqs, max_decode_len)

    total: int | None = sum(host) if host is not None else None
    num_tokens = _num_tokens(num_tokens, host, num_reqs, max_decode_len)
    check_int("num_tokens", num_tokens, lo=0, hi=_INT32_MAX)
    if total is not None and num_tokens < total:
        raise ValueError(f"num_tokens={num_tokens} is smaller than sum(decode_lens)={total}")
    if num_reqs * max_decode_len > _INT32_MAX:
        raise ValueError("len(seq_lens) * max_decode_len must fit in int32")

    is_uniform = host is not None and len(set(host)) <= 1
    if uniform is True and not is_uniform:
        raise ValueError(
            "uniform=True needs host-known decode_lens that are all equal"
            + (" (got device data)" if host is None else f" (got {sorted(set(host))})")
        )
    use_uniform = is_uniform and uniform is not False
    if device_dl is not None and num_reqs > MAX_REQUESTS_RAGGED:
        raise ValueError(
            f"seq_lens has {num_reqs} requests; the ragged kernel takes at most "
            f"{MAX_REQUESTS_RAGGED} with device decode_lens (query_start_loc has no limit)"
        )
    if not use_uniform and host is not None:
        # Ragged (or forced ragged) with host-known lengths: their offsets go to the device.
        query_start_loc = _to_device(list(accumulate(host, initial=0)), device)

    if out is None:
        out = _empty_expanded(num_tokens, width, device)
    else:
        _check_expanded_out(
            out,
            num_tokens,
            width,
            device,
            seq_lens=seq_lens,
            block_table=block_table,
            decode_lens=device_dl,
            query_start_loc=query_start_loc,
        )

    _launch_expand(
        seq_lens,
        block_table,
        out,
        uniform_n=(host[0] if host else 0) if use_uniform else None,
        device_decode_lens=device_dl,
        query_start_loc=query_start_loc,
        max_decode_len=max_decode_len,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=interleave,
        config=config,
        enable_pdl=enable_pdl,
    )
    return out


def native_decode_seq_lens(
    seq_lens: torch.Tensor,
    *,
    next_n: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Per-token lengths in the un-flattened ``[B, next_n]`` layout (one launch).

    For kernels that take ``next_n`` query tokens per request natively (all ``n_b`` equal).

    Args:
        seq_lens: int32 ``[B]``, total length ``L_b`` of each request (negatives read as 0).
        next_n: query tokens per request (>= 1).
        dcp_size, dcp_rank, interleave: as in :func:`expand_decode_tokens`; the lengths
            are localised to ``dcp_rank`` after the causal offset is applied.
        out: optional int32 ``[B, next_n]`` buffer on the same device (any strides; sharing
            memory with ``seq_lens`` raises ``ValueError``).
        config, enable_pdl: as in :func:`expand_decode_tokens`.

    Returns:
        int32 ``[B, next_n]``: ``out[b, j] = max(L_b - next_n + 1 + j, 0)`` (DCP-localised).
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        out = _empty_native(seq_lens, next_n) if out is None else out
        _native_decode_seq_lens_op(seq_lens, next_n, dcp_size, dcp_rank, interleave, out,
                                   encode_config(config), enable_pdl)  # fmt: skip
        return out
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    config = check_expand_config(config)
    # The kernel holds a next_pow2(next_n)-wide tile of draft positions.
    check_int("next_n", next_n, lo=1, hi=MAX_NEXT_N)
    check_dcp(dcp_size, dcp_rank, interleave)
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = _empty_native(seq_lens, next_n)
    else:
        check_tensor("out", out, dtype=torch.int32, ndim=2, device=seq_lens.device)
        check_output("out", out, (num_reqs, next_n), wide_dims=(0, 1))
        check_no_overlap("out", out, seq_lens=seq_lens)
    _launch_native(
        seq_lens,
        out,
        None,
        next_n=next_n,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=interleave,
        config=config,
        enable_pdl=enable_pdl,
    )
    return out


def dcp_local_seq_lens(
    seq_lens: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave: int = 1,
    out: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Localise lengths to one decode-context-parallel rank (elementwise, one launch).

    Args:
        seq_lens: int32 ``[N]``, global lengths (negatives read as 0); any stride.
        dcp_size: number of DCP ranks ``W`` (>= 1).
        dcp_rank: this rank, in ``[0, dcp_size)``.
        interleave: tokens per group ``I`` (>= 1); position ``p`` lives on rank ``(p // I) % W``.
        out: optional int32 ``[N]`` buffer on the same device; may be ``seq_lens`` itself
            (the same view: in place), but no other view sharing its memory.
        config, enable_pdl: as in :func:`expand_decode_tokens` (only ``config.pdl`` applies).

    Returns:
        int32 ``[N]``: the number of positions ``p < seq_lens[i]`` owned by ``dcp_rank``.
        Example: ``W=2``, rank 1, ``I=1``: ``[8, 9, 10] -> [4, 4, 5]``.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        if out is None:
            out = _empty_lens(seq_lens)
        elif out is seq_lens:  # in place: an op's mutated argument may not alias its input
            seq_lens = seq_lens.clone()
        _dcp_local_seq_lens_op(seq_lens, dcp_size, dcp_rank, interleave, out,
                               encode_config(config), enable_pdl)  # fmt: skip
        return out
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    config = check_expand_config(config)
    check_dcp(dcp_size, dcp_rank, interleave)
    if out is None:
        out = _empty_lens(seq_lens)
    else:
        _check_out_1d("out", out, seq_lens.shape[0], seq_lens.device)
        same_view = out.data_ptr() == seq_lens.data_ptr() and out.stride() == seq_lens.stride()
        if not same_view:  # elementwise: in place is fine, a shifted overlap is not
            check_no_overlap("out", out, seq_lens=seq_lens)
    _launch_dcp_local(
        seq_lens, out, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave,
        config=config, enable_pdl=enable_pdl,
    )  # fmt: skip
    return out


# ---- the custom ops -------------------------------------------------------------------------


@custom_op(
    "expand_decode_tokens",
    public=expand_decode_tokens,
    mutates_args=("out_seq_lens", "out_block_table", "out_decode_lens", "out_req_id"),
    represents={
        "decode_lens": ("host_decode_lens", "decode_lens"),
        "out": ("out_seq_lens", "out_block_table", "out_decode_lens", "out_req_id"),
    },
)
def _expand_decode_tokens_op(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    host_decode_lens: list[int] | None,
    decode_lens: torch.Tensor | None,
    max_decode_len: int,
    num_tokens: int,
    uniform: bool | None,
    query_start_loc: torch.Tensor | None,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    out_seq_lens: torch.Tensor,
    out_block_table: torch.Tensor,
    out_decode_lens: torch.Tensor,
    out_req_id: torch.Tensor,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    out = ExpandedDecodeTokens(out_seq_lens, out_block_table, out_decode_lens, out_req_id)
    run_eager(
        expand_decode_tokens, seq_lens, block_table,
        host_decode_lens if decode_lens is None else decode_lens,
        max_decode_len=max_decode_len, num_tokens=num_tokens, uniform=uniform,
        query_start_loc=query_start_loc, dcp_size=dcp_size, dcp_rank=dcp_rank,
        interleave=interleave, out=out, config=decode_config(config, ExpandConfig),
        enable_pdl=enable_pdl,
    )  # fmt: skip


def _expand_through_op(
    seq_lens, block_table, decode_lens, max_decode_len, num_tokens, uniform, query_start_loc,
    dcp_size, dcp_rank, interleave, out, config, enable_pdl,
) -> ExpandedDecodeTokens:  # fmt: skip
    """:func:`expand_decode_tokens` under ``torch.compile``: decode lengths as the op takes
    them (host ints, or a device tensor), the outputs allocated as the eager path does."""
    num_reqs, width = block_table.shape
    host, device_lens = None, None
    if isinstance(decode_lens, torch.Tensor):
        if decode_lens.device.type == "cpu" and seq_lens.device.type != "cpu":
            host = decode_lens.tolist()  # host lengths for a device kernel: a host read
        else:
            device_lens = decode_lens
    elif isinstance(decode_lens, int):
        host = [decode_lens] * num_reqs
    elif decode_lens is not None:
        host = list(decode_lens)
    num_tokens = _num_tokens(num_tokens, host, num_reqs, max_decode_len)
    out = _empty_expanded(num_tokens, width, seq_lens.device) if out is None else out
    _expand_decode_tokens_op(
        seq_lens, block_table, host, device_lens, max_decode_len, num_tokens, uniform,
        query_start_loc, dcp_size, dcp_rank, interleave, *out, encode_config(config),
        enable_pdl,
    )  # fmt: skip
    return out


@custom_op("native_decode_seq_lens", public=native_decode_seq_lens, mutates_args=("out",))
def _native_decode_seq_lens_op(
    seq_lens: torch.Tensor,
    next_n: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    out: torch.Tensor,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    run_eager(
        native_decode_seq_lens, seq_lens, next_n=next_n, dcp_size=dcp_size, dcp_rank=dcp_rank,
        interleave=interleave, out=out, config=decode_config(config, ExpandConfig),
        enable_pdl=enable_pdl,
    )  # fmt: skip


@custom_op("dcp_local_seq_lens", public=dcp_local_seq_lens, mutates_args=("out",))
def _dcp_local_seq_lens_op(
    seq_lens: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    out: torch.Tensor,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    run_eager(
        dcp_local_seq_lens, seq_lens, dcp_size=dcp_size, dcp_rank=dcp_rank,
        interleave=interleave, out=out, config=decode_config(config, ExpandConfig),
        enable_pdl=enable_pdl,
    )  # fmt: skip


# ---- output sizes (one rule each, for both paths) -------------------------------------------


def _num_tokens(
    num_tokens: int | None, host: list[int] | None, num_reqs: int, max_decode_len: int
) -> int:
    """Rows of an expansion: ``num_tokens``, else every host-known token, else the bound."""
    if num_tokens is not None:
        return num_tokens
    return sum(host) if host is not None else num_reqs * max_decode_len


def _empty_native(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    return torch.empty((seq_lens.shape[0], next_n), dtype=torch.int32, device=seq_lens.device)


def _empty_lens(seq_lens: torch.Tensor) -> torch.Tensor:
    return torch.empty(seq_lens.shape[0], dtype=torch.int32, device=seq_lens.device)


# ---- the metadata builder's launches under torch.compile ------------------------------------


def launch_native_through_op(
    seq_lens: torch.Tensor, out: torch.Tensor, decode_lens_out: torch.Tensor | None, *,
    next_n: int, **kw,
) -> None:  # fmt: skip
    """``DecodeMetadataBuilder``'s native launch through the op: the lengths, then
    ``decode_lens_out`` (the kernel's second output) filled with ``next_n``."""
    native_decode_seq_lens(seq_lens, next_n=next_n, out=out, **kw)
    if decode_lens_out is not None:
        decode_lens_out.fill_(next_n)


def launch_expand_through_op(
    seq_lens: torch.Tensor, block_table: torch.Tensor, out: ExpandedDecodeTokens, *,
    uniform_n: int | None = None, device_decode_lens: torch.Tensor | None = None, **kw,
) -> None:  # fmt: skip
    """``DecodeMetadataBuilder``'s flattened launch through the op (same kernel: uniform
    ``n``, ``query_start_loc`` or device decode lengths)."""
    lens = uniform_n if device_decode_lens is None else device_decode_lens
    expand_decode_tokens(
        seq_lens, block_table, lens, num_tokens=out.seq_lens.shape[0],
        uniform=True if uniform_n is not None else None, out=out, **kw,
    )  # fmt: skip
