"""Plain-PyTorch references for the cache formats: writers, readers, dequantisers.

Written for clarity, not speed. The byte layouts are described in
:mod:`sparse_mla.ops.kv_cache.layout`; these functions are the executable definition the
Triton writers are compared against bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layout import (
    AMAX_FLOOR,
    FP8_MAX,
    MLA_NOPE_DIM,
    MLA_ROPE_DIM,
    MLA_SCALE_FLOOR,
    MLA_TILE,
    indexer_k_cache_layout,
    mla_cache_layout,
)
from .model1 import (
    MODEL1_NOPE_DIM,
    MODEL1_NUM_TILES,
    MODEL1_SCALE_BYTES,
    MODEL1_TILE,
    MODEL1_VALUE_BYTES,
    model1_cache_layout,
)


def _ceil_log2_pow2(x: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(x))`` as fp32 for fp64 ``x > 0``, exactly, on any device.

    ``torch.frexp`` splits ``x`` exactly into ``m * 2**e`` with m in [0.5, 1), so
    ``ceil(log2(x))`` is ``e``, or ``e - 1`` when ``m == 0.5`` (x a power of two). Not
    ``torch.log2``: on CUDA it is not exact at powers of two (amax = 7 gave 2**-5, not 2**-6).
    """
    m, e = torch.frexp(x)
    e = e.long() - (m == 0.5).long()
    return ((e + 1023) << 52).view(torch.float64).float()  # 2**e from its IEEE-754 bits


def pow2_scale_reference(amax: torch.Tensor) -> torch.Tensor:
    """The indexer K cache's scale (DeepGEMM's and vLLM's indexer writer's rule):
    ``2 ** ceil(log2(max(amax, 1e-4) / 448))`` as fp32, exactly, on any device. The fp64
    division cannot round an fp32 ``amax`` onto a power of two it is not.

    Args:
        amax: float tensor of any shape, the largest magnitude of each quantisation group.
    """
    a = amax.float().clamp_min(AMAX_FLOOR).double()  # the floor as the fp32 value, like kernels
    return _ceil_log2_pow2(a / FP8_MAX)


def flashmla_scale_reference(amax: torch.Tensor) -> torch.Tensor:
    """The MLA latent cache's scale (FlashMLA's ``quantize_k_cache`` and vLLM's ``fp8_ds_mla``
    writer): ``2 ** ceil(log2(max(amax / 448, 1e-4)))`` as fp32, exactly, on any device. The
    floor is on the scale (``2**-13`` at least), not on ``amax``.

    Args:
        amax: float tensor of any shape, the largest magnitude of each 128-value tile.
    """
    return _ceil_log2_pow2((amax.float().double() / FP8_MAX).clamp_min(MLA_SCALE_FLOOR))


def quantize_pow2_e4m3(
    x: torch.Tensor, group: int, scale_rule: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the last dim of ``x`` in groups of ``group`` values with power-of-two scales.

    Args:
        x: float tensor ``[..., G * group]``; non-finite values as in the writers (NaN -> 0x7F,
            +-inf saturated to +-448, the scale from the finite values).
        scale_rule: amax -> scale (default :func:`pow2_scale_reference`, the indexer's rule;
            :func:`flashmla_scale_reference` for the MLA cache).
    Returns:
        ``(values, scales)``: float8_e4m3fn ``[..., G * group]`` and fp32 ``[..., G]`` with
        ``x ~= values * scales`` (per group).
    """
    rule = pow2_scale_reference if scale_rule is None else scale_rule
    xf = x.float().unflatten(-1, (-1, group))
    # Scale from the finite values; NaN stays NaN, +-inf saturates to +-448 (module docs).
    finite = xf.abs().nan_to_num(nan=0.0, posinf=0.0)
    scale = rule(finite.amax(dim=-1))
    y = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)  # exact: scale is a power of two
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(y.isnan(), 0x7F, q)  # one NaN code, whatever the sign
    return q.view(torch.float8_e4m3fn).flatten(-2), scale


def _slots(slot_mapping: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, slots) of the entries the writers act on: 0 <= slot < num_slots."""
    s = slot_mapping.long()
    keep = (s >= 0) & (s < num_slots)
    return keep.nonzero().flatten(), s[keep]


def _indexer_fp8_views(c3: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views of DeepGEMM's page layout: values [P, page, D], scale bytes [P, page, 4]."""
    pages, page, _ = c3.shape
    s0 = c3.stride(0)
    values = c3.as_strided((pages, page, head_dim), (s0, head_dim, 1))
    scales = c3.as_strided(
        (pages, page, 4), (s0, 4, 1), storage_offset=c3.storage_offset() + page * head_dim
    )
    return values, scales


def write_indexer_k_reference(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Reference for :func:`~sparse_mla.ops.kv_cache.write_indexer_k` (same arguments).

    Args:
        k: bf16 ``[T, D]`` new keys.
        k_cache: bf16 ``[P, page, D]`` or uint8 ``[P, page, 1, D + 4]`` (DeepGEMM layout),
            written in place.
        slot_mapping: int ``[T]``; entries outside ``[0, P * page)`` (e.g. -1) are skipped.
    """
    lay = indexer_k_cache_layout(k_cache)
    tok, slot = _slots(slot_mapping, lay.num_pages * lay.block_size)
    page, off = slot // lay.block_size, slot % lay.block_size
    if not lay.fp8:
        lay.cache3[page, off] = k[tok]
        return k_cache
    values, scale_bytes = _indexer_fp8_views(lay.cache3, lay.head_dim)
    q, scale = quantize_pow2_e4m3(k[tok], lay.head_dim)  # one scale per token
    values[page, off] = q.view(torch.uint8)
    scale_bytes[page, off] = scale.view(torch.uint8).reshape(-1, 4)  # native (little) endian
    return k_cache


def indexer_k_cache_values_and_scales(
    k_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a uint8 fp8 indexer cache into float8_e4m3fn values ``[P, page, D]`` and fp32
    scales ``[P, page]`` (copies)."""
    lay = indexer_k_cache_layout(k_cache)
    if not lay.fp8:
        raise ValueError("k_cache is bf16: it has no fp8 values or scales")
    values, scale_bytes = _indexer_fp8_views(lay.cache3, lay.head_dim)
    return (
        values.contiguous().view(torch.float8_e4m3fn),
        scale_bytes.contiguous().view(torch.float32).squeeze(-1),
    )


def dequantize_indexer_k_cache(k_cache: torch.Tensor) -> torch.Tensor:
    """Every key of an indexer K cache as fp32 ``[P, page, D]`` (fp8: ``value * scale``, exact).

    Args:
        k_cache: bf16 ``[P, page, D]`` (or ``[P, page, 1, D]``) or uint8
            ``[P, page, 1, D + 4]`` (or ``[P, page, D + 4]``) in DeepGEMM's layout.
    """
    lay = indexer_k_cache_layout(k_cache)
    if not lay.fp8:
        return lay.cache3.float()
    values, scales = indexer_k_cache_values_and_scales(k_cache)
    return values.float() * scales.unsqueeze(-1)


def write_mla_latent_reference(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Reference for :func:`~sparse_mla.ops.kv_cache.write_mla_latent` (same arguments):
    FlashMLA's bytes (scales by :func:`flashmla_scale_reference`).

    Args:
        kv_c: bf16 ``[T, 512]`` nope latents; k_pe: bf16 ``[T, 64]`` rope keys.
        kv_cache: bf16 ``[P, page, 576]`` or uint8 ``[P, page, 1, 656]``, written in place.
        slot_mapping: int ``[T]``; entries outside ``[0, P * page)`` are skipped.
    """
    nope, rope = kv_c.shape[1], k_pe.shape[1]
    lay = mla_cache_layout(kv_cache, nope, rope)
    tok, slot = _slots(slot_mapping, lay.num_pages * lay.block_size)
    page, off = slot // lay.block_size, slot % lay.block_size
    if not lay.fp8:
        lay.cache3[page, off] = torch.cat([kv_c[tok], k_pe[tok]], dim=-1)
        return kv_cache
    q, scale = quantize_pow2_e4m3(kv_c[tok], MLA_TILE, flashmla_scale_reference)
    n = len(tok)
    row = torch.cat(
        [
            q.view(torch.uint8),
            scale.contiguous().view(torch.uint8).reshape(n, 4 * (nope // MLA_TILE)),
            k_pe[tok].contiguous().view(torch.uint8).reshape(n, 2 * rope),
        ],
        dim=-1,
    )
    lay.cache3[page, off] = row
    return kv_cache


def dequantize_mla_cache(
    kv_cache: torch.Tensor, nope_dim: int = MLA_NOPE_DIM, rope_dim: int = MLA_ROPE_DIM
) -> torch.Tensor:
    """Every latent of an MLA cache as fp32 ``[P, page, nope + rope]`` (exact conversion).

    Args:
        kv_cache: bf16 ``[P, page, 576]`` (or ``[P, page, 1, 576]``) or FlashMLA's fp8 format,
            uint8 ``[P, page, 1, 656]`` (or ``[P, page, 656]``).
    """
    lay = mla_cache_layout(kv_cache, nope_dim, rope_dim)
    c3 = lay.cache3
    if not lay.fp8:
        return c3.float()
    ntiles = nope_dim // MLA_TILE
    nope = c3[..., :nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = c3[..., nope_dim : nope_dim + 4 * ntiles].contiguous().view(torch.float32)
    rope = c3[..., nope_dim + 4 * ntiles :].contiguous().view(torch.bfloat16).float()
    nope = (nope.unflatten(-1, (ntiles, MLA_TILE)) * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat([nope, rope], dim=-1)


# ---- DeepSeek-V4 (MODEL1) formats: model1.py --------------------------------------------------


def quantize_model1_row(kv: torch.Tensor) -> torch.Tensor:
    """One MODEL1 fp8 row per token, in the row's logical byte order (not the page layout).

    Args:
        kv: bf16 ``[..., 512]``: 448 values to quantise, then 64 RoPE values copied.

    Returns:
        uint8 ``[..., 584]``: 448 e4m3 values (power-of-two scales, FlashMLA's rule:
        :func:`flashmla_scale_reference`, one per 64 values) | the 64 RoPE values as bf16
        bytes | 7 ue8m0 scale bytes ``log2(scale) + 127`` | one pad byte, 0.
        :func:`write_model1_latent_reference` places the parts in a page.
    """
    lead = kv.shape[:-1]
    nope, rope = kv[..., :MODEL1_NOPE_DIM], kv[..., MODEL1_NOPE_DIM:]
    q, scale = quantize_pow2_e4m3(nope, MODEL1_TILE, flashmla_scale_reference)
    # A power of two's ue8m0 byte is its biased fp32 exponent (frexp: 2**k = 0.5 * 2**(k+1)).
    _, e = torch.frexp(scale.double())
    e8m0 = (e - 1 + 127).to(torch.uint8)
    pad = torch.zeros((*lead, 1), dtype=torch.uint8, device=kv.device)
    rope_bytes = rope.contiguous().view(torch.uint8)
    return torch.cat([q.view(torch.uint8), rope_bytes, e8m0, pad], dim=-1)


def dequantize_model1_row(row: torch.Tensor) -> torch.Tensor:
    """The 512 values of MODEL1 fp8 rows in logical byte order (:func:`quantize_model1_row`).

    Args:
        row: uint8 ``[..., 584]``.

    Returns:
        fp32 ``[..., 512]``: ``bf16(e4m3 * 2 ** (byte - 127))`` for the 448 quantised values
        (the product rounded to bf16 as FlashMLA's kernel reads it: exact for the scales the
        writer makes; 0xFF reads as NaN), then the 64 RoPE values.
    """
    values = row[..., :MODEL1_NOPE_DIM].contiguous().view(torch.float8_e4m3fn).double()
    rope = row[..., MODEL1_NOPE_DIM:MODEL1_VALUE_BYTES].contiguous().view(torch.bfloat16)
    e8m0 = row[..., MODEL1_VALUE_BYTES : MODEL1_VALUE_BYTES + MODEL1_NUM_TILES].double()
    scale = torch.where(e8m0 == 255, float("nan"), torch.exp2(e8m0 - 127))  # exact in fp64
    nope = (values.unflatten(-1, (MODEL1_NUM_TILES, MODEL1_TILE)) * scale[..., None]).flatten(-2)
    return torch.cat([nope.float().bfloat16().float(), rope.float()], dim=-1)


def model1_page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views of a MODEL1 fp8 cache's page layout (:mod:`~sparse_mla.ops.kv_cache.model1`):
    value rows uint8 ``[P, page, 576]`` and scale rows uint8 ``[P, page, 8]`` (views, not
    copies: writing them writes the cache)."""
    lay = model1_cache_layout(kv_cache)
    if not lay.fp8:
        raise ValueError("kv_cache is a MODEL1 bf16 cache: it has no fp8 page layout")
    c3, page = lay.cache3, lay.block_size
    values = c3.as_strided((lay.num_pages, page, MODEL1_VALUE_BYTES), (lay.page_stride, 576, 1))
    scales = c3.as_strided(
        (lay.num_pages, page, MODEL1_SCALE_BYTES),
        (lay.page_stride, MODEL1_SCALE_BYTES, 1),
        storage_offset=c3.storage_offset() + page * MODEL1_VALUE_BYTES,
    )
    return values, scales


def model1_rows(kv_cache: torch.Tensor, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """The logical 584-byte rows (:func:`quantize_model1_row` order) of the tokens at
    ``(page, off)`` (int tensors of one shape ``[...]``) of a MODEL1 fp8 cache:
    uint8 ``[..., 584]`` (a copy)."""
    values, scales = model1_page_views(kv_cache)
    return torch.cat([values[page, off], scales[page, off]], dim=-1)


def write_model1_latent_reference(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Reference for ``write_mla_latent`` on a MODEL1 cache (same arguments).

    Args:
        kv_c: bf16 ``[T, 448]``; k_pe: bf16 ``[T, 64]``.
        kv_cache: MODEL1 fp8 uint8 ``[P, page, 1, 584]`` (or 3-D) or bf16 ``[P, page, 512]``,
            written in place.
        slot_mapping: int ``[T]``; entries outside ``[0, P * page)`` are skipped.
    """
    lay = model1_cache_layout(kv_cache)
    tok, slot = _slots(slot_mapping, lay.num_pages * lay.block_size)
    page, off = slot // lay.block_size, slot % lay.block_size
    kv = torch.cat([kv_c[tok], k_pe[tok]], dim=-1)
    if not lay.fp8:
        lay.cache3[page, off] = kv
        return kv_cache
    row = quantize_model1_row(kv)
    values, scales = model1_page_views(kv_cache)
    values[page, off] = row[:, :MODEL1_VALUE_BYTES]
    scales[page, off] = row[:, MODEL1_VALUE_BYTES:]
    return kv_cache


def dequantize_model1_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """Every row of a MODEL1 cache as fp32 ``[P, page, 512]`` (fp8: :func:`dequantize_model1_row`).

    Args:
        kv_cache: uint8 ``[P, page, 1, 584]`` (or 3-D) or bf16 ``[P, page, 512]`` (or 4-D).
    """
    lay = model1_cache_layout(kv_cache)
    if not lay.fp8:
        return lay.cache3.float()
    values, scales = model1_page_views(kv_cache)
    return dequantize_model1_row(torch.cat([values, scales], dim=-1))
