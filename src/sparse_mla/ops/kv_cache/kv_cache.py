"""Paged KV-cache writers: the indexer K cache and the MLA latent cache, bf16 or fp8.

Formats (SPEC section 4; a slot id is ``page_id * block_size + offset``):

* **Indexer K cache**, bf16: ``[num_pages, block_size, D]`` (or ``[num_pages, block_size, 1, D]``).
* **Indexer K cache**, fp8 (DeepGEMM's layout): ``D + 4`` bytes per token, but laid out per
  page as ``block_size * D`` e4m3 values (token-major) followed by ``block_size`` fp32 scales,
  viewed as uint8 ``[num_pages, block_size, 1, D + 4]`` (or ``[num_pages, block_size, D + 4]``).
  The view's rows are *not* tokens: token ``o`` of page ``p`` has its values at bytes
  ``p * stride0 + o * D + [0, D)`` and its scale at bytes ``p * stride0 + block_size * D + 4 * o``.
  One scale per token (per ``D`` values; D = 128 in V3.2, DeepGEMM's quantisation block).
* **MLA latent cache**, bf16: ``[num_pages, block_size, 576]`` (or ``[..., 1, 576]``).
* **MLA latent cache**, fp8 (FlashMLA's V3.2 format): 656 bytes per token, tokens contiguous
  within a page: 512 e4m3 ("nope") | 4 fp32 scales, one per 128 nope values | 64 bf16 rope
  (not quantised); uint8 ``[num_pages, block_size, 1, 656]`` (or ``[num_pages, block_size, 656]``).

Scales: powers of two (exact when kernels convert them to bf16 or e8m0, and ``x / scale`` is
exact, so the only rounding is the final fp32 -> e4m3 round-to-nearest-even; ``|x / scale| <=
448`` by construction, so no finite value saturates). ``amax`` is the group's largest finite
magnitude. Each format follows the rule of the upstream writer whose bytes it reproduces:

* **MLA latent cache** (FlashMLA's ``quantize_k_cache``, vLLM's ``fp8_ds_mla`` writer):
  ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))``. The floor applies to the *scale*:
  never below ``2**-13``, so an all-zero group gets ``2**-13`` and every group with
  ``amax <= 448 * 2**-13`` (0.0546875) shares it.
* **Indexer K cache** (DeepGEMM's ``per_custom_dims_cast_to_fp8``, vLLM's
  ``indexer_k_quant_and_cache`` with ue8m0 scales): ``scale = 2 ** ceil(log2(max(amax, 1e-4)
  / 448))``. The floor applies to ``amax`` *before* the division, so an all-zero group gets
  ``2**-22``.

Non-finite inputs (fp8 formats): the scale comes from the group's finite values only, a NaN
is stored as e4m3 NaN (0x7F, whatever its sign) and +-inf as +-448 (so it reads back as
+-448 * scale); the group's other values are quantised as if those were absent. The bf16
formats store every value as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._checks import check_int, check_same_device, check_tensor
from ..._launch import PlanCache, byte_extent, check_disjoint, launch, tensor_meta
from ..._runtime import INTERPRETER, canonical_device, cdiv, next_pow2

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_TILE = 128  # nope values per fp32 scale in FlashMLA's format
INDEXER_HEAD_DIM = 128


def indexer_fp8_bytes_per_token(head_dim: int = INDEXER_HEAD_DIM) -> int:
    """Bytes per token of the fp8 indexer K cache: ``head_dim`` e4m3 values + one fp32 scale."""
    return head_dim + 4


def mla_fp8_bytes_per_token(nope_dim: int = MLA_NOPE_DIM, rope_dim: int = MLA_ROPE_DIM) -> int:
    """Bytes per token of FlashMLA's fp8 latent format (656 for 512 + 64)."""
    return nope_dim + 4 * (nope_dim // MLA_TILE) + 2 * rope_dim


# ---- format parsing (shared with the indexer logits kernel) --------------------------------


@dataclass(frozen=True)
class IndexerKCacheLayout:
    """What :func:`indexer_k_cache_layout` learned about an indexer K cache.

    ``cache3`` is the cache as a 3-D tensor (the size-1 head dim dropped). For the fp8 format
    ``values`` is ``cache3`` viewed as float8_e4m3fn and ``scales`` as float32, and
    ``page_stride`` is the byte distance between pages; for bf16 ``values`` is ``cache3``.
    """

    fp8: bool
    num_pages: int
    block_size: int
    head_dim: int
    cache3: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor | None
    page_stride: int


def _as_3d(name: str, cache: torch.Tensor) -> torch.Tensor:
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(
                f"{name}: a 4-D cache must be [num_pages, block_size, 1, bytes_or_dim], "
                f"got shape {tuple(cache.shape)}"
            )
        cache = cache[:, :, 0, :]
    elif cache.dim() != 3:
        raise ValueError(
            f"{name} must be 3-D [num_pages, block_size, dim] or 4-D [num_pages, block_size, 1, "
            f"dim], got shape {tuple(cache.shape)}"
        )
    if cache.shape[1] < 1:  # kernels split slots by it (slot // block_size)
        raise ValueError(f"{name}: block_size (dimension 1) must be >= 1, got 0")
    return cache


def _check_fp32_viewable(name: str, c3: torch.Tensor) -> None:
    # fp32 scales are read/written through a float32 view of the byte cache.
    if c3.stride(2) != 1:
        raise ValueError(f"{name}: the last (byte) dimension must be contiguous")
    if c3.storage_offset() % 4 or c3.stride(0) % 4 or c3.stride(1) % 4:
        raise ValueError(
            f"{name}: page/token strides and the storage offset must be multiples of 4 bytes "
            f"so the fp32 scales are aligned (strides {tuple(c3.stride())}, offset "
            f"{c3.storage_offset()})"
        )


def indexer_k_cache_layout(k_cache: torch.Tensor, name: str = "k_cache") -> IndexerKCacheLayout:
    """Validate an indexer K cache and describe it (format detected from the dtype).

    Args:
        k_cache: bf16 ``[num_pages, block_size, D]`` / ``[num_pages, block_size, 1, D]`` (any
            strides), or uint8 ``[num_pages, block_size, 1, D + 4]`` / ``[num_pages,
            block_size, D + 4]`` in DeepGEMM's per-page layout (see the module docstring; each
            page's bytes contiguous, page stride a multiple of 4).
    """
    check_tensor(name, k_cache, dtype=(torch.bfloat16, torch.uint8))
    c3 = _as_3d(name, k_cache)
    pages, page, last = c3.shape
    if k_cache.dtype == torch.bfloat16:
        if last < 1:
            raise ValueError(f"{name}: head dim must be >= 1")
        return IndexerKCacheLayout(False, pages, page, last, c3, c3, None, c3.stride(0))
    d = last - 4
    if d < 4 or d % 4:
        raise ValueError(
            f"{name}: fp8 indexer cache rows must be D + 4 bytes with D a positive multiple of 4, "
            f"got {last}"
        )
    if c3.stride(2) != 1 or c3.stride(1) != last:
        raise ValueError(
            f"{name}: the fp8 indexer cache stores each page as one contiguous byte block "
            f"(token stride must be {last}, byte stride 1), got strides {tuple(c3.stride())}"
        )
    _check_fp32_viewable(name, c3)
    return IndexerKCacheLayout(
        True,
        pages,
        page,
        d,
        c3,
        c3.view(torch.float8_e4m3fn),
        c3.view(torch.float32),
        c3.stride(0),
    )


# ---- shared jit helpers ---------------------------------------------------------------------


# FlashMLA's floor on the MLA scale, and ceil(log2) of it: the smallest scale's exponent.
MLA_SCALE_FLOOR = 1e-4
MLA_SCALE_MIN_EXP = math.ceil(math.log2(MLA_SCALE_FLOOR))  # -13


@triton.jit
def _ceil_log2_over_448(a):
    """``ceil(log2(a / 448))`` of a finite fp32 ``a > 0``, exactly, from its bits (no
    division, no log2: identical on every backend). With ``a = m * 2**E``, m in [1, 2) and
    448 = 1.75 * 2**8, it is ``E - 8`` if ``m <= 1.75`` else ``E - 7``. (0 and subnormals give
    exponents below -130, which both rules floor.)"""
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _pow2_pair(k):
    """(``2**k``, ``2**-k``) as fp32 from their bits (``-126 <= k <= 127``)."""
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def pow2_scale(amax):
    """(scale, 1/scale) of the indexer rule, ``2**ceil(log2(max(amax, 1e-4) / 448))``."""
    return _pow2_pair(_ceil_log2_over_448(tl.maximum(amax, 1e-4)))


@triton.jit
def flashmla_pow2_scale(amax, MIN_EXP: tl.constexpr):
    """(scale, 1/scale) of FlashMLA's rule, ``2**ceil(log2(max(amax / 448, 1e-4)))``:
    ``ceil(log2)`` is monotone, so the floor on the scale is a floor on its exponent
    (``MIN_EXP = ceil(log2(1e-4)) = -13``). No division by 448 in fp32 either: its rounding
    never moves a quotient onto or off a power of two (the smallest mantissa above 1.75
    gives a quotient 0.57 ulp above 1), so the bits' answer is the formula's."""
    return _pow2_pair(tl.maximum(_ceil_log2_over_448(amax), MIN_EXP))


@triton.jit
def finite_amax(x, axis: tl.constexpr):
    """Largest finite magnitude along ``axis`` (NaN and +-inf count as 0): the scale of a
    group is set by its finite values alone."""
    ax = tl.abs(x)
    return tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=axis)


@triton.jit
def e4m3_bits(y):
    """fp32 -> float8_e4m3fn bit pattern (uint8), round to nearest even; magnitudes past 448
    (inf included) saturate to +-448, as PyTorch's clamp-then-convert does, and every NaN
    becomes 0x7F.

    Integer arithmetic instead of ``.to(tl.float8e4nv)``: Triton 3.9's interpreter rounds that
    conversion wrongly (no carry into the exponent, subnormals truncated); this gives the same
    bits as PyTorch's conversion on every backend.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    # Normal range (|y| >= 2**-6): round the 23-bit mantissa to 3 bits; the carry of the
    # rounding add propagates into the exponent by itself. Rebias 127 -> 7.
    rn = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rn >> 20) - ((127 - 7) << 3)
    # Subnormal range: units of 2**-9; shift the 24-bit significand right with RNE.
    e = (mag >> 23) - 127
    sig = (mag & 0x7FFFFF) | 0x800000
    sh = tl.minimum(14 - e, 31)
    sh = tl.maximum(sh, 1)
    q = sig >> sh
    rem = sig - (q << sh)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    code = tl.where(e >= -6, normal, sub)
    code = tl.where(mag > 0x43E00000, 0x7E, code) | sign  # past 448.0 (inf too): saturate
    # NaN: the one canonical e4m3 NaN (GPUs do not keep a NaN's sign through arithmetic).
    return tl.where(mag > 0x7F800000, 0x7F, code).to(tl.uint8)


# ---- indexer K writer -----------------------------------------------------------------------


@triton.jit
def _write_indexer_k_kernel(
    k_ptr,
    slot_ptr,
    val_ptr,
    scale_ptr,
    num_tokens,
    num_slots,
    k_s0,
    k_s1,
    c_s0,
    c_s1,
    c_s2,
    scale_s0,
    scale_base,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tok_ok, other=-1).to(tl.int64)
    # -1 (padding) and out-of-range slots are skipped: device data is never trusted.
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    page = slot // PAGE
    off = slot % PAGE
    d = tl.arange(0, DP)
    m = ok[:, None] & (d < D)[None, :]
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * k_s0 + d[None, :] * k_s1, mask=m, other=0.0)
    if FP8:
        xf = x.to(tl.float32)
        scale, inv = pow2_scale(finite_amax(xf, 1))
        q = e4m3_bits(xf * inv[:, None])  # exact product: inv is a power of two
        # Page layout: all block_size * D values first, then block_size fp32 scales.
        tl.store(val_ptr + (page * c_s0 + off * D)[:, None] + d[None, :], q, mask=m)
        tl.store(scale_ptr + page * scale_s0 + scale_base + off, scale, mask=ok)
    else:
        dst = val_ptr + (page * c_s0 + off * c_s1)[:, None] + d[None, :] * c_s2
        tl.store(dst, x, mask=m)


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but there are {num_tokens} "
            "tokens to write"
        )
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")


def write_indexer_k(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Write new indexer keys into the paged indexer K cache (quantising for the fp8 format).

    Args:
        k: bf16 ``[T, D]``, one key per new token (any strides).
        k_cache: the cache, written in place; format from its dtype: bf16
            ``[num_pages, block_size, D]`` (or ``[..., 1, D]``), or uint8
            ``[num_pages, block_size, 1, D + 4]`` (or ``[num_pages, block_size, D + 4]``) in
            DeepGEMM's per-page layout (module docstring). fp8 keys get one power-of-two fp32
            scale per token.
        slot_mapping: int32 or int64 ``[T]``, contiguous: destination slot
            ``page_id * block_size + offset`` of each token. ``-1`` skips the token (padding).
            Slots ``>= num_pages * block_size`` (or any other negative value) are device data
            that cannot be checked without a sync: the kernel skips them silently.

    Returns:
        ``k_cache`` (the same tensor). Two tokens with the same slot race (one wins).
    """
    if torch.compiler.is_compiling():  # through torch.ops.sparse_mla (library.py)
        from ... import library

        return library.write_indexer_k(k, k_cache, slot_mapping)
    try:  # the checks read metadata only: done once per key
        key = (tensor_meta(k), tensor_meta(k_cache), tensor_meta(slot_mapping))
    except AttributeError:
        key = None
    plan = _PLANS.get(key) or _PLANS.put(key, _indexer_plan(k, k_cache, slot_mapping))
    ext = plan.extents
    check_disjoint(
        "k_cache", k_cache, ext[0], (("k", k, ext[1]), ("slot_mapping", slot_mapping, ext[2]))
    )
    if plan.grid is not None:
        c3 = k_cache[:, :, 0, :] if plan.squeeze else k_cache
        scale = c3.view(torch.float32) if plan.fp8 else c3  # bf16: scale pointer unused
        args = (k, slot_mapping, c3, scale, *plan.ints)
        launch(_write_indexer_k_kernel, plan.grid, args, plan.kwargs, plan)
    return k_cache


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _WritePlan:
    """A cache write's launch, decided from its arguments' metadata."""

    grid: tuple | None  # None: nothing to write
    ints: tuple
    kwargs: dict
    extents: tuple  # bytes the cache, then each input, reach
    fp8: bool
    squeeze: bool  # a 4-D cache: drop its size-1 head dim


_PLANS = PlanCache()


def _indexer_plan(k, k_cache, slot_mapping) -> _WritePlan:
    check_tensor("k", k, dtype=torch.bfloat16, ndim=2)
    lay = indexer_k_cache_layout(k_cache)
    num_tokens, d = k.shape
    if d != lay.head_dim:
        raise ValueError(f"k has head dim {d} but k_cache holds {lay.head_dim}-dim keys")
    _check_slots(slot_mapping, num_tokens)
    check_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    block_t = 64 if INTERPRETER else 8  # the interpreter pays per program, not per element
    c3 = lay.cache3
    if lay.fp8:
        c_s0, c_s1, c_s2 = c3.stride(0), d, 1
        scale_s0, scale_base = c3.stride(0) // 4, lay.block_size * d // 4
    else:
        c_s0, c_s1, c_s2 = c3.stride()
        scale_s0, scale_base = 0, 0
    empty = num_tokens == 0 or lay.num_pages == 0
    return _WritePlan(
        grid=None if empty else (cdiv(num_tokens, block_t),),
        ints=(
            num_tokens,
            lay.num_pages * lay.block_size,
            *k.stride(),
            c_s0,
            c_s1,
            c_s2,
            scale_s0,
            scale_base,
        ),  # fmt: skip
        kwargs=dict(
            PAGE=lay.block_size, D=d, DP=next_pow2(d), FP8=lay.fp8, BLOCK_T=block_t, num_warps=4
        ),  # fmt: skip
        extents=tuple(map(byte_extent, (k_cache, k, slot_mapping))),
        fp8=lay.fp8,
        squeeze=k_cache.dim() == 4,
    )


# ---- MLA latent writer ----------------------------------------------------------------------


def _check_mla_dims(nope_dim: int, rope_dim: int) -> None:
    check_int("nope_dim", nope_dim, lo=MLA_TILE)
    check_int("rope_dim", rope_dim, lo=0)
    if nope_dim % MLA_TILE:
        raise ValueError(f"nope_dim must be a multiple of {MLA_TILE}, got {nope_dim}")


@dataclass(frozen=True)
class MlaCacheLayout:
    """What :func:`mla_cache_layout` learned about an MLA latent cache (``cache3``: 3-D)."""

    fp8: bool
    num_pages: int
    block_size: int
    nope_dim: int
    rope_dim: int
    cache3: torch.Tensor


def mla_cache_layout(
    kv_cache: torch.Tensor,
    nope_dim: int = MLA_NOPE_DIM,
    rope_dim: int = MLA_ROPE_DIM,
    name: str = "kv_cache",
) -> MlaCacheLayout:
    """Validate an MLA latent cache for the given nope/rope split (format from the dtype).

    Args:
        kv_cache: bf16 ``[num_pages, block_size, nope + rope]`` (or ``[..., 1, nope + rope]``,
            any strides), or uint8 ``[num_pages, block_size, 1, B]`` / ``[num_pages, block_size,
            B]`` with ``B = nope + 4 * nope / 128 + 2 * rope`` (656 for V3.2), one token per
            row, bytes contiguous, strides multiples of 4.
    """
    _check_mla_dims(nope_dim, rope_dim)
    check_tensor(name, kv_cache, dtype=(torch.bfloat16, torch.uint8))
    c3 = _as_3d(name, kv_cache)
    pages, page, last = c3.shape
    fp8 = kv_cache.dtype == torch.uint8
    want = mla_fp8_bytes_per_token(nope_dim, rope_dim) if fp8 else nope_dim + rope_dim
    if last != want:
        kind = "bytes (fp8 format)" if fp8 else "values (bf16)"
        raise ValueError(
            f"{name}: expected {want} {kind} per token for nope {nope_dim} + rope {rope_dim}, "
            f"got {last}"
        )
    if fp8:
        _check_fp32_viewable(name, c3)
    return MlaCacheLayout(fp8, pages, page, nope_dim, rope_dim, c3)


@triton.jit
def _write_mla_kernel(
    kvc_ptr,
    kpe_ptr,
    slot_ptr,
    u8_ptr,
    f32_ptr,
    bf16_ptr,
    num_tokens,
    num_slots,
    kvc_s0,
    kvc_s1,
    kpe_s0,
    kpe_s1,
    c_s0,
    c_s1,
    c_s2,
    PAGE: tl.constexpr,
    NOPE: tl.constexpr,
    NOPE_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    TILE: tl.constexpr,
    NT: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_MIN_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tok_ok, other=-1).to(tl.int64)
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    row = (slot // PAGE) * c_s0 + (slot % PAGE) * c_s1  # element (bf16) or byte (fp8) offset
    t64 = t.to(tl.int64)
    d = tl.arange(0, NOPE_P)
    dm = ok[:, None] & (d < NOPE)[None, :]
    x = tl.load(kvc_ptr + t64[:, None] * kvc_s0 + d[None, :] * kvc_s1, mask=dm, other=0.0)
    r = tl.arange(0, ROPE_P)
    rm = ok[:, None] & (r < ROPE)[None, :]
    pe = tl.load(kpe_ptr + t64[:, None] * kpe_s0 + r[None, :] * kpe_s1, mask=rm, other=0.0)
    if FP8:
        x3 = tl.reshape(x.to(tl.float32), [BLOCK_T, NT, TILE])
        scale, inv = flashmla_pow2_scale(finite_amax(x3, 2), SCALE_MIN_EXP)  # [BLOCK_T, NT]
        q = tl.reshape(e4m3_bits(x3 * inv[:, :, None]), [BLOCK_T, NOPE_P])
        tl.store(u8_ptr + row[:, None] + d[None, :], q, mask=dm)
        tile = tl.arange(0, NT)
        sm = ok[:, None] & (tile < NOPE // TILE)[None, :]
        # 656-byte row: nope bytes | NOPE/TILE fp32 scales | rope bf16 (rows are 4-aligned).
        tl.store(f32_ptr + (row // 4 + NOPE // 4)[:, None] + tile[None, :], scale, mask=sm)
        rope_at = (row + NOPE + 4 * (NOPE // TILE)) // 2
        tl.store(bf16_ptr + rope_at[:, None] + r[None, :], pe, mask=rm)
    else:
        tl.store(bf16_ptr + row[:, None] + d[None, :] * c_s2, x, mask=dm)
        tl.store(bf16_ptr + row[:, None] + (NOPE + r[None, :]) * c_s2, pe, mask=rm)


def write_mla_latent(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Write new MLA latents (nope part ``kv_c`` + rope part ``k_pe``) into the paged cache.

    Args:
        kv_c: bf16 ``[T, 512]`` (``[T, nope]``), the compressed latent of each new token
            (any strides; e.g. ``kv[:, :512]`` of a ``[T, 576]`` tensor).
        k_pe: bf16 ``[T, 64]`` (``[T, rope]``), its rope key (e.g. ``kv[:, 512:]``).
        kv_cache: written in place; bf16 ``[num_pages, block_size, 576]`` (or ``[..., 1, 576]``)
            or FlashMLA's fp8 format, uint8 ``[num_pages, block_size, 1, 656]`` (or
            ``[num_pages, block_size, 656]``): per token 512 e4m3 | 4 fp32 power-of-two scales
            (one per 128 nope values, FlashMLA's rule: module docstring) | 64 bf16 rope
            copied unquantised. The bytes equal FlashMLA's ``quantize_k_cache`` for finite
            inputs. Or a DeepSeek-V4 (MODEL1) cache, uint8 ``[num_pages, block_size, 1, 584]``
            or bf16 ``[num_pages, block_size, 512]``, with ``kv_c`` ``[T, 448]`` and ``k_pe``
            ``[T, 64]``: see :func:`sparse_mla.ops.kv_cache.model1.write_model1_latent`.
        slot_mapping: int32 or int64 ``[T]``, contiguous, ``page_id * block_size + offset``;
            ``-1`` skips the token; other out-of-range slots are skipped silently (device data).

    Returns:
        ``kv_cache`` (the same tensor).
    """
    if torch.compiler.is_compiling():  # through torch.ops.sparse_mla (library.py)
        from ... import library

        return library.write_mla_latent(kv_c, k_pe, kv_cache, slot_mapping)
    if _model1.routes_to_model1(kv_c, kv_cache):  # DeepSeek-V4's formats (model1.py)
        return _model1.write_model1_latent(kv_c, k_pe, kv_cache, slot_mapping)
    try:  # the checks read metadata only: done once per key
        key = tuple(map(tensor_meta, (kv_c, k_pe, kv_cache, slot_mapping)))
    except AttributeError:
        key = None
    plan = _PLANS.get(key) or _PLANS.put(key, _mla_plan(kv_c, k_pe, kv_cache, slot_mapping))
    ext = plan.extents
    inputs = (
        ("kv_c", kv_c, ext[1]),
        ("k_pe", k_pe, ext[2]),
        ("slot_mapping", slot_mapping, ext[3]),
    )
    check_disjoint("kv_cache", kv_cache, ext[0], inputs)
    if plan.grid is not None:
        c3 = kv_cache[:, :, 0, :] if plan.squeeze else kv_cache
        if plan.fp8:
            u8, f32, bf = c3, c3.view(torch.float32), c3.view(torch.bfloat16)
        else:
            u8 = f32 = bf = c3
        args = (kv_c, k_pe, slot_mapping, u8, f32, bf, *plan.ints)
        launch(_write_mla_kernel, plan.grid, args, plan.kwargs, plan)
    return kv_cache


def _check_rope_width(k_pe: torch.Tensor, kv_cache: torch.Tensor, nope: int) -> None:
    """Blame ``k_pe`` when the cache's rows are the standard layout for ``nope`` (64 rope
    values after it) and ``k_pe`` is not that wide; any other mismatch is the cache's
    (:func:`mla_cache_layout` names it)."""
    check_tensor("kv_cache", kv_cache, dtype=(torch.bfloat16, torch.uint8))
    last = kv_cache.shape[-1] if kv_cache.dim() >= 3 else None
    if last is None:
        return
    fp8 = kv_cache.dtype == torch.uint8
    spare = last - nope - (4 * (nope // MLA_TILE) if fp8 else 0)  # rope values or bytes
    rope = spare // 2 if fp8 else spare
    if rope != MLA_ROPE_DIM or (fp8 and spare % 2) or k_pe.shape[1] == rope:
        return
    kind = "bytes (fp8 format)" if fp8 else "values"
    raise ValueError(
        f"k_pe has {k_pe.shape[1]} values per token, but kv_cache rows ({last} {kind}) hold "
        f"{nope} nope + {rope} rope values: k_pe must be [T, {rope}]"
    )


def _mla_plan(kv_c, k_pe, kv_cache, slot_mapping) -> _WritePlan:
    check_tensor("kv_c", kv_c, dtype=torch.bfloat16, ndim=2)
    check_tensor("k_pe", k_pe, dtype=torch.bfloat16, ndim=2)
    num_tokens, nope = kv_c.shape
    if k_pe.shape[0] != num_tokens:
        raise ValueError(f"kv_c has {num_tokens} tokens but k_pe has {k_pe.shape[0]}")
    if nope < MLA_TILE or nope % MLA_TILE:
        raise ValueError(f"kv_c must be [T, nope] with nope a multiple of {MLA_TILE}, got {nope}")
    _check_rope_width(k_pe, kv_cache, nope)
    lay = mla_cache_layout(kv_cache, nope, k_pe.shape[1])
    _check_slots(slot_mapping, num_tokens)
    check_same_device(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    c3 = lay.cache3
    if lay.fp8:
        c_s0, c_s1, c_s2 = c3.stride(0), c3.stride(1), 1  # bytes
    else:
        c_s0, c_s1, c_s2 = c3.stride()
    block_t = 16 if INTERPRETER else 4
    empty = num_tokens == 0 or lay.num_pages == 0
    kwargs = dict(
        PAGE=lay.block_size,
        NOPE=nope,
        NOPE_P=next_pow2(nope),
        ROPE=lay.rope_dim,
        ROPE_P=max(next_pow2(lay.rope_dim), 2),
        TILE=MLA_TILE,
        NT=next_pow2(nope) // MLA_TILE,
        FP8=lay.fp8,
        SCALE_MIN_EXP=MLA_SCALE_MIN_EXP,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return _WritePlan(
        grid=None if empty else (cdiv(num_tokens, block_t),),
        ints=(
            num_tokens,
            lay.num_pages * lay.block_size,
            *kv_c.stride(),
            *k_pe.stride(),
            c_s0,
            c_s1,
            c_s2,
        ),  # fmt: skip
        kwargs=kwargs,
        extents=tuple(map(byte_extent, (kv_cache, kv_c, k_pe, slot_mapping))),
        fp8=lay.fp8,
        squeeze=kv_cache.dim() == 4,
    )


# ---- allocation helpers ---------------------------------------------------------------------


def _check_bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")


def new_indexer_k_cache(
    num_pages: int,
    block_size: int,
    head_dim: int = INDEXER_HEAD_DIM,
    *,
    fp8: bool,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Zeroed indexer K cache: uint8 ``[num_pages, block_size, 1, head_dim + 4]`` (fp8) or bf16
    ``[num_pages, block_size, head_dim]``, on ``device`` (default: where kernels run). The
    fp8 format needs ``head_dim`` a positive multiple of 4 (the scales stay 4-byte aligned)."""
    device = canonical_device(device)
    check_int("num_pages", num_pages, lo=0)
    check_int("block_size", block_size, lo=1)
    check_int("head_dim", head_dim, lo=1)
    _check_bool("fp8", fp8)
    if fp8 and head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for the fp8 format, got {head_dim}")
    if fp8:
        return torch.zeros(
            (num_pages, block_size, 1, head_dim + 4), dtype=torch.uint8, device=device
        )
    return torch.zeros((num_pages, block_size, head_dim), dtype=torch.bfloat16, device=device)


def new_mla_cache(
    num_pages: int,
    block_size: int,
    *,
    fp8: bool | None = None,
    nope_dim: int | None = None,
    rope_dim: int | None = None,
    device: torch.device | str | None = None,
    format: str | None = None,  # noqa: A002  (the natural name for it)
) -> torch.Tensor:
    """Zeroed MLA latent cache on ``device`` (default: where kernels run), in ``format``:

    * ``"fp8"`` (or ``fp8=True``): FlashMLA's V3.2 format, uint8 ``[num_pages, block_size,
      1, 656]``;
    * ``"bf16"`` (or ``fp8=False``): bf16 ``[num_pages, block_size, 576]``;
    * ``"model1_fp8"``: DeepSeek-V4's (FlashMLA's MODEL1) format, a uint8 ``[num_pages,
      block_size, 1, 584]`` view of pages padded to a multiple of 576 bytes
      (:mod:`sparse_mla.ops.kv_cache.model1`);
    * ``"model1_bf16"``: bf16 ``[num_pages, block_size, 512]``.

    ``nope_dim`` / ``rope_dim`` (V3.2 formats; default 512 / 64): a positive multiple of 128
    and ``>= 0``, as the writer requires; the MODEL1 formats are 448 + 64 only. ``fp8`` and
    ``format`` may both be given if they agree.
    """
    device = canonical_device(device)
    check_int("num_pages", num_pages, lo=0)
    check_int("block_size", block_size, lo=1)
    fmt = _model1.resolve_mla_format(fp8, format)
    if fmt.startswith("model1"):
        for name, v, want in (("nope_dim", nope_dim, 448), ("rope_dim", rope_dim, 64)):
            if v is not None and v != want:
                raise ValueError(f"{name} of a {fmt} cache is {want}, got {v}")
        return _model1.new_model1_cache(num_pages, block_size, fp8=fmt == "model1_fp8",
                                        device=device)  # fmt: skip
    fp8 = fmt == "fp8"
    nope_dim = MLA_NOPE_DIM if nope_dim is None else nope_dim
    rope_dim = MLA_ROPE_DIM if rope_dim is None else rope_dim
    _check_mla_dims(nope_dim, rope_dim)
    if fp8:
        width = mla_fp8_bytes_per_token(nope_dim, rope_dim)
        return torch.zeros((num_pages, block_size, 1, width), dtype=torch.uint8, device=device)
    return torch.zeros(
        (num_pages, block_size, nope_dim + rope_dim), dtype=torch.bfloat16, device=device
    )


from . import model1 as _model1  # noqa: E402  (DeepSeek-V4's formats; it imports this module)
