"""Host side of DeepSeek-V4's second index set (``extra_*`` of :func:`sparse_mla_decode`) and
of the MODEL1 row format: their checks, and what the Triton kernel takes for them.

V4 attends, in one softmax, to a query row's sliding window of raw tokens (the first set:
``kv_cache`` + ``indices``) and to compressed entries in another cache (the second set:
``extra_kv_cache`` + ``extra_indices``), as FlashMLA's ``extra_k_cache`` /
``extra_indices_in_kvcache``. The second set follows the first's rules: int32 ids (global
slots, or request-local positions through ``extra_block_table`` with the same ``req_id``),
hostile ids masked and never read, valid counts ``extra_topk_length`` clamped to
``[0, topk2]``, duplicates counted as given. Its cache has the first's format (fp8 or bf16,
V3.2 or MODEL1 rows), any page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._checks import check_int, check_shape, check_tensor
from ..kv_cache import Model1CacheLayout, mla_cache_format, model1_cache_layout
from ..kv_cache.layout import mla_cache_layout

INT32_MAX = 2**31 - 1
MODEL1_FORMATS = ("model1_bf16", "model1_fp8")


def model1_layout(kv_cache: torch.Tensor, name: str = "kv_cache") -> Model1CacheLayout:
    """The MODEL1 cache's layout; an fp8 one is read through a bf16 view too (its RoPE), so
    its page stride and storage offset must be even (FlashMLA's 576-byte multiples are)."""
    lay = model1_cache_layout(kv_cache, name)
    if lay.fp8 and (lay.page_stride % 2 or lay.cache3.storage_offset() % 2):
        raise ValueError(
            f"{name}: a MODEL1 fp8 cache's page stride and storage offset must be even (its "
            f"bf16 RoPE values are read as bf16), got {lay.page_stride} and "
            f"{lay.cache3.storage_offset()}"
        )
    return lay


def cache_layout(kv_cache: torch.Tensor, name: str = "kv_cache"):
    """(layout, MODEL1?) of a cache of any of the four formats."""
    if mla_cache_format(kv_cache) in MODEL1_FORMATS:
        return model1_layout(kv_cache, name), True
    return mla_cache_layout(kv_cache, name=name), False


def kv_strides(lay, c3: torch.Tensor) -> tuple[int, int, int]:
    """The kernel's (page, row, element) strides of a cache view (fp8: bytes; MODEL1 fp8: the
    576-byte value rows, whose scale rows follow each page's)."""
    if isinstance(lay, Model1CacheLayout) and lay.fp8:
        return c3.stride(0), 576, 1
    return (c3.stride(0), c3.stride(1), 1) if lay.fp8 else c3.stride()


@dataclass(frozen=True)
class ExtraPlan:
    """What a call's second set fixes from its arguments' metadata."""

    topk: int  # its columns
    page: int  # its cache's page size (the kernel's X_PAGE)
    has_len: bool
    ints: tuple  # the kernel's x_* integers


EXTRA_NAMES = ("extra_kv_cache", "extra_indices", "extra_topk_length", "extra_block_table")


def check_extra(
    kv_cache: torch.Tensor,
    num_tokens: int,
    fused: bool,
    extras: tuple,
    extra_block_size: int | None,
    dev: torch.device,
) -> ExtraPlan | None:
    """Check the second set (``extras``: the tensors of ``EXTRA_NAMES``) against the first;
    None when there is none."""
    cache, idx, lengths, bt = extras
    if all(v is None for v in extras) and extra_block_size is None:
        return None
    if cache is None or idx is None:
        raise ValueError("extra_kv_cache and extra_indices go together: pass both or neither")
    lay, _ = cache_layout(cache, "extra_kv_cache")
    if mla_cache_format(cache) != mla_cache_format(kv_cache):
        raise ValueError(
            f"extra_kv_cache must have kv_cache's format ({mla_cache_format(kv_cache)}), got "
            f"{mla_cache_format(cache)}"
        )
    check_tensor("extra_kv_cache", cache, device=dev)
    check_tensor("extra_indices", idx, dtype=torch.int32, ndim=2, device=dev)
    if idx.shape[0] != num_tokens or idx.shape[1] < 1:
        raise ValueError(
            f"extra_indices must be [T, topk2] with T = {num_tokens} and topk2 >= 1, got "
            f"{tuple(idx.shape)}"
        )
    if lengths is not None:
        check_tensor("extra_topk_length", lengths, dtype=torch.int32, ndim=1, device=dev)
        check_shape("extra_topk_length", lengths, (num_tokens,))
    if fused != (bt is not None):
        raise ValueError(
            "extra_block_table goes with block_table and req_id (the fused remap of both sets)"
        )
    if not fused and extra_block_size is not None:
        raise ValueError("extra_block_size is only used with extra_block_table")
    page = lay.block_size
    bt_ints = (0, 0, 0, 0, 1)
    if fused:
        check_tensor("extra_block_table", bt, dtype=torch.int32, ndim=2, device=dev)
        bs = page
        if extra_block_size is not None:
            bs = check_int("extra_block_size", extra_block_size, lo=1)
        bt_ints = (*bt.stride(), bt.shape[1], bt.shape[0], bs)
    c3 = cache[:, :, 0, :] if cache.dim() == 4 else cache
    ints = (
        idx.shape[1], min(lay.num_pages * page, INT32_MAX), *kv_strides(lay, c3), *idx.stride(),
        *bt_ints, 1 if lengths is None else lengths.stride(0),
    )  # fmt: skip
    return ExtraPlan(idx.shape[1], page, lengths is not None, ints)


def word_view(c3: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's 3-D byte view as fp32 words, which the kernels read as 32-bit words (a
    MODEL1 cache whose pages do not start 4-byte aligned: the bytes; only the Triton kernel,
    which reads it by bytes, takes that)."""
    if c3.stride(0) % 4 or c3.storage_offset() % 4 or c3.shape[-1] % 4:
        return c3
    return c3.view(torch.float32)


def extra_tensors(extras: tuple, fp8: bool, fallback: torch.Tensor) -> tuple:
    """The kernels' six x_* pointers (``fallback`` where absent: never read)."""
    cache, idx, lengths, bt = extras
    if cache is None:
        return (fallback,) * 6
    c3 = cache[:, :, 0, :] if cache.dim() == 4 else cache
    if fp8:
        u8, f32, bf = c3, word_view(c3), c3.view(torch.bfloat16)
    else:
        u8 = f32 = bf = c3
    return (u8, f32, bf, idx, idx if lengths is None else lengths, idx if bt is None else bt)


# The integers of an absent second set (x_topk 0 ... x_len_s0 1).
NO_EXTRA_INTS = (0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1)
