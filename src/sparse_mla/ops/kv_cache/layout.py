"""The paged KV-cache formats: the indexer K cache and the MLA latent cache, bf16 or fp8.

Formats (a slot id is ``page_id * block_size + offset``):

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

from dataclasses import dataclass

import torch

from ..._checks import check_int, check_tensor
from ..._runtime import canonical_device
from . import model1 as _model1  # DeepSeek-V4's formats (it imports only write.py)
from .write import MLA_SCALE_FLOOR, MLA_SCALE_MIN_EXP  # noqa: F401  (the formats' scale rule)

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

    def store_strides(self) -> tuple[int, int, int, int, int]:
        """``(c_s0, c_s1, c_s2, scale_s0, scale_base)`` of ``write.store_indexer_k_rows``:
        fp8, bytes (page, token = D, 1) and, in fp32 words, the page stride and the first
        scale's offset in a page; bf16, ``cache3``'s strides and two zeros."""
        if not self.fp8:
            return (*self.cache3.stride(), 0, 0)
        s0, d = self.cache3.stride(0), self.head_dim
        return s0, d, 1, s0 // 4, self.block_size * d // 4


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
