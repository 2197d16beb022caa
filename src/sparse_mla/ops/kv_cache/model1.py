"""DeepSeek-V4's MLA cache formats ("MODEL1", FlashMLA's name): 512-wide rows that are both
key and value (448 "nope" values, then 64 RoPE values), fp8 or bf16.

* **MODEL1 fp8** (FlashMLA's ``MODEL1_FP8Sparse``): 584 bytes per token, but *not* one row
  per token: each page is split like the DeepGEMM indexer cache. A page of ``block_size``
  tokens holds first ``block_size`` value rows of 576 bytes (448 e4m3 values, then the 64
  RoPE values as bf16, 128 bytes, not quantised), then ``block_size`` scale rows of 8 bytes
  (7 ue8m0 scales, one per 64 values, then one pad byte). Token ``o`` of page ``p``:

  - values at bytes ``p * page_stride + 576 * o + [0, 448)``,
  - RoPE (bf16, little endian) at ``p * page_stride + 576 * o + [448, 576)``,
  - scale ``g`` (g < 7) at ``p * page_stride + 576 * block_size + 8 * o + g``, the pad
    byte at ``... + 8 * o + 7`` (written 0 here; FlashMLA leaves it unset and never reads it).

  Viewed as uint8 ``[num_pages, block_size, 1, 584]`` (or ``[num_pages, block_size, 584]``)
  with token stride 584 (FlashMLA requires it) and any page stride ``>= 584 * block_size``;
  the view's "rows" are not tokens. :func:`new_model1_cache` pads the page stride to a
  multiple of 576 bytes, as FlashMLA's ``tests/quant.py`` allocates it (its SM100 kernel
  addresses the cache in 576-byte TMA units, so the page stride must be a multiple of 576
  there).
* **MODEL1 bf16**: bf16 ``[num_pages, block_size, 512]`` (or ``[..., 1, 512]``), any strides.

Scales (FlashMLA's ``quantize_k_cache``): ``2 ** ceil(log2(max(amax / 448, 1e-4)))`` per 64
values, the same rule as the V3.2 format's (so at least ``2**-13``), stored as its ue8m0 byte
``log2(scale) + 127``; values ``e4m3(x / scale)``, round to nearest even. Non-finite inputs
as in the V3.2 writer (:mod:`sparse_mla.ops.kv_cache.write`): the scale comes from the
group's finite values, NaN is stored as 0x7F, +-inf as +-448. Dequantised, a value is
``bf16(e4m3 * 2 ** (byte - 127))`` (exact for the scales the writer makes), as FlashMLA
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ..._checks import check_int, check_same_device, check_slot_mapping, check_tensor
from ..._launch import HostPlanCache, byte_extent, check_disjoint, launch, tensor_meta
from ..._runtime import INTERPRETER, canonical_device, cdiv, jit
from .write import MLA_SCALE_MIN_EXP, e4m3_bits, finite_amax, flashmla_pow2_scale

MODEL1_NOPE_DIM = 448
MODEL1_ROPE_DIM = 64
MODEL1_DIM = MODEL1_NOPE_DIM + MODEL1_ROPE_DIM  # 512: d_qk = d_v
MODEL1_TILE = 64  # values per ue8m0 scale
MODEL1_NUM_TILES = MODEL1_NOPE_DIM // MODEL1_TILE  # 7
MODEL1_VALUE_BYTES = MODEL1_NOPE_DIM + 2 * MODEL1_ROPE_DIM  # 576: a token's value row
MODEL1_SCALE_BYTES = MODEL1_NUM_TILES + 1  # 8: 7 scales + 1 pad byte
MODEL1_BYTES_PER_TOKEN = MODEL1_VALUE_BYTES + MODEL1_SCALE_BYTES  # 584
MODEL1_PAGE_ALIGN = 576  # FlashMLA pads each page's bytes to a multiple of this
MLA_FORMATS = ("bf16", "fp8", "model1_bf16", "model1_fp8")


def model1_page_bytes(block_size: int) -> int:
    """Bytes between pages of a MODEL1 fp8 cache as :func:`new_model1_cache` (and FlashMLA's
    tests) allocate it: ``584 * block_size`` rounded up to a multiple of 576."""
    check_int("block_size", block_size, lo=1)
    return cdiv(MODEL1_BYTES_PER_TOKEN * block_size, MODEL1_PAGE_ALIGN) * MODEL1_PAGE_ALIGN


def mla_cache_format(kv_cache: torch.Tensor) -> str | None:
    """Which of :data:`MLA_FORMATS` a cache's dtype and row width say it is (None: none).

    uint8 rows of 656 bytes: ``"fp8"`` (V3.2); of 584: ``"model1_fp8"``; bf16 rows of 576:
    ``"bf16"`` (V3.2); of 512: ``"model1_bf16"``. Shapes and strides are not checked here.
    """
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() < 3:
        return None
    widths = {
        torch.uint8: {656: "fp8", MODEL1_BYTES_PER_TOKEN: "model1_fp8"},
        torch.bfloat16: {576: "bf16", MODEL1_DIM: "model1_bf16"},
    }
    return widths.get(kv_cache.dtype, {}).get(kv_cache.shape[-1])


def resolve_mla_format(fp8: object, format: object) -> str:  # noqa: A002  (the public name)
    """The cache format of a ``new_mla_cache(fp8=..., format=...)`` call: ``format`` (one of
    :data:`MLA_FORMATS`), or from ``fp8`` (the V3.2 formats); both given must agree."""
    if fp8 is not None and not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    if format is None:
        if fp8 is None:
            raise TypeError(f"pass format= (one of {MLA_FORMATS}) or fp8=")
        return "fp8" if fp8 else "bf16"
    if format not in MLA_FORMATS:
        raise ValueError(f"format must be one of {MLA_FORMATS}, got {format!r}")
    if fp8 is not None and fp8 != format.endswith("fp8"):
        raise ValueError(f"fp8={fp8} contradicts format={format!r}")
    return format


@dataclass(frozen=True)
class Model1CacheLayout:
    """What :func:`model1_cache_layout` learned about a MODEL1 cache.

    ``cache3`` is the cache as a 3-D tensor (the size-1 head dim dropped): uint8
    ``[P, page, 584]`` (fp8) or bf16 ``[P, page, 512]``. ``page_stride`` is ``cache3``'s
    stride 0 (bytes for fp8, elements for bf16).
    """

    fp8: bool
    num_pages: int
    block_size: int
    page_stride: int
    cache3: torch.Tensor


def model1_cache_layout(kv_cache: torch.Tensor, name: str = "kv_cache") -> Model1CacheLayout:
    """Validate a MODEL1 cache (module docstring) and describe it.

    Args:
        kv_cache: uint8 ``[P, page, 1, 584]`` / ``[P, page, 584]`` (MODEL1 fp8: token stride
            584, byte stride 1, page stride ``>= 584 * page``) or bf16 ``[P, page, 512]`` /
            ``[P, page, 1, 512]`` (any strides).
    """
    check_tensor(name, kv_cache, dtype=(torch.uint8, torch.bfloat16))
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(
                f"{name}: a 4-D cache must be [num_pages, block_size, 1, width], got shape "
                f"{tuple(kv_cache.shape)}"
            )
        kv_cache = kv_cache[:, :, 0, :]
    elif kv_cache.dim() != 3:
        raise ValueError(
            f"{name} must be 3-D [num_pages, block_size, width] or 4-D [num_pages, block_size, "
            f"1, width], got shape {tuple(kv_cache.shape)}"
        )
    pages, page, last = kv_cache.shape
    if page < 1:
        raise ValueError(f"{name}: block_size (dimension 1) must be >= 1, got 0")
    fp8 = kv_cache.dtype == torch.uint8
    want = MODEL1_BYTES_PER_TOKEN if fp8 else MODEL1_DIM
    if last != want:
        kind = "bytes (MODEL1 fp8 format)" if fp8 else "values (MODEL1 bf16 format)"
        raise ValueError(f"{name}: expected {want} {kind} per token, got {last}")
    s0, s1, s2 = kv_cache.stride()
    if fp8 and (s2 != 1 or s1 != MODEL1_BYTES_PER_TOKEN or (pages > 1 and s0 < page * s1)):
        raise ValueError(
            f"{name}: a MODEL1 fp8 cache stores each page as one byte block (token stride "
            f"{MODEL1_BYTES_PER_TOKEN}, byte stride 1, page stride >= {page * 584}), got "
            f"strides {(s0, s1, s2)}"
        )
    return Model1CacheLayout(fp8, pages, page, s0, kv_cache)


@jit
def store_model1_rows(
    u8_ptr, bf16_ptr, x, page, off, ok, c_s0, c_s1, c_s2,
    PAGE: tl.constexpr, FP8: tl.constexpr, SCALE_MIN_EXP: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Store bf16 rows ``x`` ([BLOCK_T, 512]: 448 values, then the 64 RoPE values) at
    ``(page, off)`` (int64 [BLOCK_T]) of a MODEL1 cache where ``ok`` (module docstring). The
    one copy of the format's store, shared by the writer and the compressor
    (``ops/compressor``)."""
    d = tl.arange(0, 512)
    dm = ok[:, None] & (d < 448)[None, :]
    rm = ok[:, None] & (d >= 448)[None, :]
    if FP8:
        # Group 7 holds the RoPE values: its scale is computed and never stored.
        x3 = tl.reshape(x.to(tl.float32), [BLOCK_T, 8, 64])
        scale, inv = flashmla_pow2_scale(finite_amax(x3, 2), SCALE_MIN_EXP)  # [BLOCK_T, 8]
        q = tl.reshape(e4m3_bits(x3 * inv[:, :, None]), [BLOCK_T, 512])
        row = page * c_s0 + off * 576  # the token's 576-byte value row
        tl.store(u8_ptr + row[:, None] + d[None, :], q, mask=dm)
        # RoPE value d (>= 448) as its bf16 bytes at 448 + 2 (d - 448), little endian (byte
        # stores: no alignment assumed).
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        rope_at = row[:, None] + 2 * d[None, :] - 448
        tl.store(u8_ptr + rope_at, (bits & 0xFF).to(tl.uint8), mask=rm)
        tl.store(u8_ptr + rope_at + 1, (bits >> 8).to(tl.uint8), mask=rm)
        # ue8m0 byte of a power of two = its fp32 biased exponent; the pad byte is 0.
        g = tl.arange(0, 8)
        e8m0 = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e8m0 = tl.where((g < 7)[None, :], e8m0, 0).to(tl.uint8)
        scale_at = page * c_s0 + PAGE * 576 + off * 8
        tl.store(u8_ptr + scale_at[:, None] + g[None, :], e8m0, mask=ok[:, None])
    else:
        row = page * c_s0 + off * c_s1
        tl.store(bf16_ptr + row[:, None] + d[None, :] * c_s2, x, mask=ok[:, None])


@jit
def _write_model1_kernel(
    kvc_ptr, kpe_ptr, slot_ptr, u8_ptr, bf16_ptr, num_tokens, num_slots,
    kvc_s0, kvc_s1, kpe_s0, kpe_s1, c_s0, c_s1, c_s2,
    PAGE: tl.constexpr, FP8: tl.constexpr, SCALE_MIN_EXP: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tok_ok, other=-1).to(tl.int64)
    ok = tok_ok & (slot >= 0) & (slot < num_slots)  # -1 and out-of-range slots: skipped
    t64 = t.to(tl.int64)
    d = tl.arange(0, 512)  # one 512-wide row: kv_c's 448 values, then k_pe's 64
    dm = ok[:, None] & (d < 448)[None, :]
    rm = ok[:, None] & (d >= 448)[None, :]
    x = tl.load(kvc_ptr + t64[:, None] * kvc_s0 + d[None, :] * kvc_s1, mask=dm, other=0.0)
    pe_at = kpe_ptr + t64[:, None] * kpe_s0 + (d[None, :] - 448) * kpe_s1
    x = tl.where(rm, tl.load(pe_at, mask=rm, other=0.0), x)
    store_model1_rows(
        u8_ptr, bf16_ptr, x, slot // PAGE, slot % PAGE, ok, c_s0, c_s1, c_s2, PAGE, FP8,
        SCALE_MIN_EXP, BLOCK_T,
    )  # fmt: skip


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _Model1HostPlan:
    grid: tuple | None  # None: nothing to write
    ints: tuple
    kwargs: dict
    extents: tuple  # bytes the cache, kv_c, k_pe, slot_mapping reach
    fp8: bool


_PLANS = HostPlanCache()


def _host_plan(kv_c, k_pe, kv_cache, slot_mapping) -> _Model1HostPlan:
    check_tensor("kv_c", kv_c, dtype=torch.bfloat16, ndim=2)
    check_tensor("k_pe", k_pe, dtype=torch.bfloat16, ndim=2)
    num_tokens = kv_c.shape[0]
    if kv_c.shape[1] != MODEL1_NOPE_DIM:
        raise ValueError(
            f"kv_c must be [T, {MODEL1_NOPE_DIM}] for a MODEL1 cache (the first 448 values of "
            f"each 512-wide row), got {tuple(kv_c.shape)}"
        )
    if k_pe.shape != (num_tokens, MODEL1_ROPE_DIM):
        raise ValueError(
            f"k_pe must be [T, {MODEL1_ROPE_DIM}] = [{num_tokens}, {MODEL1_ROPE_DIM}] for a "
            f"MODEL1 cache (the last 64 values of each row), got {tuple(k_pe.shape)}"
        )
    lay = model1_cache_layout(kv_cache)
    check_slot_mapping(slot_mapping, num_tokens)
    check_same_device(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    block_t = 16 if INTERPRETER else 4
    empty = num_tokens == 0 or lay.num_pages == 0
    return _Model1HostPlan(
        grid=None if empty else (cdiv(num_tokens, block_t),),
        ints=(
            num_tokens,
            lay.num_pages * lay.block_size,
            *kv_c.stride(),
            *k_pe.stride(),
            *lay.cache3.stride(),
        ),  # fmt: skip
        kwargs=dict(
            PAGE=lay.block_size,
            FP8=lay.fp8,
            SCALE_MIN_EXP=MLA_SCALE_MIN_EXP,
            BLOCK_T=block_t,
            num_warps=4,
        ),  # fmt: skip
        extents=tuple(map(byte_extent, (kv_cache, kv_c, k_pe, slot_mapping))),
        fp8=lay.fp8,
    )


def write_model1_latent(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Write DeepSeek-V4 KV rows into a MODEL1 cache (what ``write_mla_latent`` does for one).

    Args:
        kv_c: bf16 ``[T, 448]``, the first 448 values of each new 512-wide row (any
            strides; e.g. ``kv[:, :448]``).
        k_pe: bf16 ``[T, 64]``, its last 64 (RoPE) values (e.g. ``kv[:, 448:]``).
        kv_cache: written in place: MODEL1 fp8 (uint8 ``[P, page, 1, 584]``, module
            docstring; FlashMLA's ``quantize_k_cache`` bytes for finite inputs, the pad byte
            0) or MODEL1 bf16 (bf16 ``[P, page, 512]``).
        slot_mapping: int32 or int64 ``[T]``, contiguous, ``page_id * block_size + offset``;
            ``-1`` skips the token; other out-of-range slots are skipped silently (device
            data). Two tokens with the same slot race (one wins).

    Returns:
        ``kv_cache`` (the same tensor).
    """
    try:  # the checks read metadata only: done once per key
        key = tuple(map(tensor_meta, (kv_c, k_pe, kv_cache, slot_mapping)))
    except AttributeError:
        key = None
    plan = _PLANS.get(key) or _PLANS.put(key, _host_plan(kv_c, k_pe, kv_cache, slot_mapping))
    ext = plan.extents
    inputs = (("kv_c", kv_c, ext[1]), ("k_pe", k_pe, ext[2]),
              ("slot_mapping", slot_mapping, ext[3]))  # fmt: skip
    check_disjoint("kv_cache", kv_cache, ext[0], inputs)
    if plan.grid is not None:
        c3 = kv_cache[:, :, 0, :] if kv_cache.dim() == 4 else kv_cache
        args = (kv_c, k_pe, slot_mapping, c3, c3, *plan.ints)
        launch(_write_model1_kernel, plan.grid, args, plan.kwargs, plan)
    return kv_cache


def routes_to_model1(kv_c: object, kv_cache: object) -> bool:
    """Whether ``write_mla_latent(kv_c, k_pe, kv_cache, ...)`` is a MODEL1 write: a 584-byte
    uint8 cache, or a 512-wide bf16 cache given 448-wide ``kv_c`` (a V3.2 cache otherwise).
    Cheap (two attribute reads): it runs on every write."""
    try:
        last, dtype = kv_cache.shape[-1], kv_cache.dtype
    except (AttributeError, IndexError):
        return False  # not a cache: the V3.2 path's checks say what is wrong
    if last == MODEL1_BYTES_PER_TOKEN:
        return dtype == torch.uint8
    shape = getattr(kv_c, "shape", ())
    return last == MODEL1_DIM and dtype == torch.bfloat16 and shape[-1:] == (MODEL1_NOPE_DIM,)


def new_model1_cache(
    num_pages: int,
    block_size: int,
    *,
    fp8: bool,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Zeroed MODEL1 cache on ``device`` (default: where kernels run): fp8, a uint8
    ``[num_pages, block_size, 1, 584]`` view with page stride :func:`model1_page_bytes`
    (FlashMLA's padding; the storage holds every page's padding too), or bf16
    ``[num_pages, block_size, 512]``."""
    device = canonical_device(device)
    check_int("num_pages", num_pages, lo=0)
    check_int("block_size", block_size, lo=1)
    if not fp8:
        return torch.zeros((num_pages, block_size, MODEL1_DIM), dtype=torch.bfloat16,
                           device=device)  # fmt: skip
    stride = model1_page_bytes(block_size)
    flat = torch.zeros((num_pages, stride), dtype=torch.uint8, device=device)
    used = flat[:, : block_size * MODEL1_BYTES_PER_TOKEN]
    return used.unflatten(1, (block_size, 1, MODEL1_BYTES_PER_TOKEN))
