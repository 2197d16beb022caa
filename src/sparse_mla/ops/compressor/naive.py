"""Plain-PyTorch reference of the compressor's decode step (the state machine: README.md).

Written for clarity, not speed: one request and one row at a time, in float64. Each row is
appended to its request's ring first; a row that closes a window then pools the window from
the ring. (The kernel reads the step's own rows from its inputs instead; with the ring sized
by :func:`~sparse_mla.ops.compressor.compressor_state_rows` both read the same values.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kv_cache.model1 import MODEL1_BYTES_PER_TOKEN, MODEL1_NOPE_DIM
from ..kv_cache.naive import write_indexer_k_reference, write_model1_latent_reference


def window_span(compress_rate: int, overlap: bool) -> int:
    """Source rows one entry pools: ``compress_rate``, twice that with CSA's overlap."""
    return compress_rate * (2 if overlap else 1)


def pool_window_reference(
    kv: torch.Tensor,
    gate: torch.Tensor,
    valid: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    compress_rate: int,
    overlap: bool,
    eps: float,
) -> torch.Tensor:
    """One compressed entry from its window, in float64.

    Args:
        kv, gate: ``[span, W]`` the window's source rows, oldest first (``span`` =
            :func:`window_span`; ``W = D`` or, with ``overlap``, ``2 D``).
        valid: bool ``[span]``; rows at negative positions are False (softmax weight 0).
        position_bias: ``[compress_rate, W]``, added to the gate of the row at window offset
            ``position % compress_rate``.
        norm_weight: ``[D]`` RMSNorm weight. cos, sin: ``[rope / 2]`` at the entry's position.
        overlap: CSA's rule: window slot ``i < rate`` (the previous window) takes features
            ``[0, D)`` of its row, slot ``i >= rate`` (this window) features ``[D, 2D)``.

    Returns:
        float64 ``[D]``: ``sum_i softmax_i(gate_i + bias) * kv_i`` per feature, RMSNorm (times
        ``norm_weight``), then RoPE on the last ``rope`` features, pairs ``(2p, 2p + 1)``
        rotated by ``cos[p], sin[p]`` (transformers' interleaved RoPE).
    """
    span, width = kv.shape
    d = width // 2 if overlap else width
    slot = torch.arange(span, device=kv.device)
    first = (slot // compress_rate) * d if overlap else torch.zeros_like(slot)
    cols = first[:, None] + torch.arange(d, device=kv.device)[None, :]
    x = kv.double().gather(1, cols).masked_fill(~valid[:, None], 0.0)  # rows never written
    bias = position_bias.double()[slot % compress_rate].gather(1, cols)
    g = gate.double().gather(1, cols) + bias
    g = g.masked_fill(~valid[:, None], float("-inf"))
    entry = (torch.softmax(g, dim=0) * x).sum(dim=0)
    entry = entry * torch.rsqrt(entry.square().mean() + eps) * norm_weight.double()
    half = cos.shape[0]
    if half:
        rope = entry[d - 2 * half :].view(half, 2)
        c, s = cos.double(), sin.double()
        even, odd = rope[:, 0], rope[:, 1]
        rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1)
        entry = torch.cat([entry[: d - 2 * half], rotated.flatten()])
    return entry


def request_rows(
    b: int,
    num_rows: int,
    max_decode_len: int,
    query_start_loc: torch.Tensor | None,
    decode_len: int | None,
) -> tuple[int, int]:
    """(first row, row count) of request ``b``: ``b * decode_len`` and ``decode_len``, or from
    ``query_start_loc`` relative to its first entry, clamped as the kernel clamps device data
    (start and end into ``[0, num_rows]``, the count into ``[0, max_decode_len]``)."""
    if query_start_loc is None:
        return b * decode_len, decode_len
    q = [int(v) for v in query_start_loc[[0, b, b + 1]].tolist()]
    start = min(max(q[1] - q[0], 0), num_rows)
    end = min(max(q[2] - q[0], start), num_rows)
    return start, min(end - start, max_decode_len)


class CompressorStep(NamedTuple):
    """What one step emitted, per step row (``N`` rows).

    entries: float64 ``[N, D]``, the entry a row's closed window produced (NaN elsewhere).
    entry_index: int64 ``[N]``, that entry's index in its request (-1: none).
    slots: int64 ``[N]``, the compressed-cache slot it goes to (-1: none, or no valid page).
    """

    entries: torch.Tensor
    entry_index: torch.Tensor
    slots: torch.Tensor


def compressor_step_reference(
    kv: torch.Tensor,
    gate: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    compress_rate: int,
    overlap: bool,
    max_decode_len: int,
    block_size: int,
    num_pages: int,
    eps: float = 1e-6,
    query_start_loc: torch.Tensor | None = None,
    decode_len: int | None = None,
    state_index: torch.Tensor | None = None,
) -> CompressorStep:
    """The step's state update (``state_kv`` / ``state_gate`` written in place) and its
    entries; arguments as :func:`~sparse_mla.ops.compressor.compressor_decode`, with the
    compressed cache's ``block_size`` and ``num_pages`` in place of the cache."""
    num_rows, width = kv.shape
    d = width // 2 if overlap else width
    span = window_span(compress_rate, overlap)
    ring = state_kv.shape[1]
    half = cos_sin.shape[1] // 2
    entries = torch.full((num_rows, d), float("nan"), dtype=torch.float64, device=kv.device)
    entry_index = torch.full((num_rows,), -1, dtype=torch.int64, device=kv.device)
    slots = torch.full_like(entry_index, -1)
    for b in range(seq_lens.shape[0]):
        start, n = request_rows(b, num_rows, max_decode_len, query_start_loc, decode_len)
        s = b if state_index is None else int(state_index[b])
        if not 0 <= s < state_kv.shape[0]:
            continue  # no state row: the request is padding
        first = int(seq_lens[b]) - n
        for j in range(n):
            pos, row = first + j, start + j
            if pos < 0:
                continue
            state_kv[s, pos % ring] = kv[row]
            state_gate[s, pos % ring] = gate[row]
            if (pos + 1) % compress_rate:
                continue
            k = (pos + 1) // compress_rate - 1
            entry_index[row] = k
            slots[row] = _entry_slot(block_table[b], k, block_size, num_pages)
            x = [pos + 1 - span + i for i in range(span)]
            at = torch.tensor([p % ring for p in x], device=kv.device)
            valid = torch.tensor([p >= 0 for p in x], device=kv.device)
            cs = cos_sin[min(max(k * compress_rate, 0), cos_sin.shape[0] - 1)]
            entries[row] = pool_window_reference(
                state_kv[s, at], state_gate[s, at], valid, position_bias, norm_weight,
                cs[:half], cs[half:], compress_rate=compress_rate, overlap=overlap, eps=eps,
            )  # fmt: skip
    return CompressorStep(entries, entry_index, slots)


def _entry_slot(block_row: torch.Tensor, k: int, block_size: int, num_pages: int) -> int:
    """Slot of entry ``k`` through its request's compressed block-table row (-1: none)."""
    col = k // block_size
    if col >= block_row.shape[0]:
        return -1
    page = int(block_row[col])
    return page * block_size + k % block_size if 0 <= page < num_pages else -1


def compressed_cache_kind(cache: torch.Tensor) -> str:
    """ "model1" for a 584-byte MODEL1 fp8 cache, else "indexer" (the indexer K cache's
    formats; a bf16 cache of 512-wide rows is MODEL1 bf16 and indexer bf16 alike)."""
    is_model1 = cache.dtype == torch.uint8 and cache.shape[-1] == MODEL1_BYTES_PER_TOKEN
    return "model1" if is_model1 else "indexer"


def write_entries_reference(
    entries: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor
) -> torch.Tensor:
    """Write bf16(``entries``) at ``slots`` (-1 skipped) with the cache format's reference
    writer (``ops/kv_cache/naive.py``); rows without an entry must have slot -1."""
    rows = entries.nan_to_num(0.0).to(torch.bfloat16)
    if compressed_cache_kind(cache) == "model1":
        nope, rope = rows[:, :MODEL1_NOPE_DIM], rows[:, MODEL1_NOPE_DIM:]
        return write_model1_latent_reference(nope, rope, cache, slots)
    return write_indexer_k_reference(rows, cache, slots)


def compressor_decode_reference(
    kv: torch.Tensor,
    gate: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    compress_rate: int,
    overlap: bool,
    max_decode_len: int,
    eps: float = 1e-6,
    query_start_loc: torch.Tensor | None = None,
    decode_len: int | None = None,
    state_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for :func:`~sparse_mla.ops.compressor.compressor_decode` (same arguments):
    :func:`compressor_step_reference`, then :func:`write_entries_reference`."""
    c3 = cache[:, :, 0, :] if cache.dim() == 4 else cache
    step = compressor_step_reference(
        kv, gate, state_kv, state_gate, seq_lens, block_table, position_bias, norm_weight,
        cos_sin, compress_rate=compress_rate, overlap=overlap, max_decode_len=max_decode_len,
        block_size=c3.shape[1], num_pages=c3.shape[0], eps=eps,
        query_start_loc=query_start_loc, decode_len=decode_len, state_index=state_index,
    )  # fmt: skip
    write_entries_reference(step.entries, step.slots, cache)
    return cache
