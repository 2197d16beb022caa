"""The cache writers ``write_indexer_k`` and ``write_mla_latent``: checks, launch plans, the
launches, and their custom ops (formats: :mod:`.layout`; kernels: :mod:`.write`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._checks import check_same_device, check_slot_mapping, check_tensor
from ..._custom_op import compiling, custom_op, run_eager
from ..._launch import HostPlanCache, byte_extent, check_disjoint, launch, tensor_meta
from ..._runtime import INTERPRETER, cdiv, next_pow2
from . import model1 as _model1
from . import write  # kernels looked up on their module (tests/kernel_compile.py)
from .layout import (
    MLA_ROPE_DIM,
    MLA_SCALE_MIN_EXP,
    MLA_TILE,
    indexer_k_cache_layout,
    mla_cache_layout,
)

# ---- indexer K writer -----------------------------------------------------------------------


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
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        _write_indexer_k_op(k, k_cache, slot_mapping)
        return k_cache
    try:  # the checks read metadata only: done once per key
        key = (tensor_meta(k), tensor_meta(k_cache), tensor_meta(slot_mapping))
    except AttributeError:
        key = None
    plan = _PLANS.get(key) or _PLANS.put(key, _indexer_host_plan(k, k_cache, slot_mapping))
    ext = plan.extents
    check_disjoint(
        "k_cache", k_cache, ext[0], (("k", k, ext[1]), ("slot_mapping", slot_mapping, ext[2]))
    )
    if plan.grid is not None:
        c3 = k_cache[:, :, 0, :] if plan.squeeze else k_cache
        scale = c3.view(torch.float32) if plan.fp8 else c3  # bf16: scale pointer unused
        args = (k, slot_mapping, c3, scale, *plan.ints)
        launch(write._write_indexer_k_kernel, plan.grid, args, plan.kwargs, plan)
    return k_cache


@custom_op("write_indexer_k", public=write_indexer_k, mutates_args=("k_cache",))
def _write_indexer_k_op(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    run_eager(write_indexer_k, k, k_cache, slot_mapping)


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _WriteHostPlan:
    """A cache write's launch, decided from its arguments' metadata."""

    grid: tuple | None  # None: nothing to write
    ints: tuple
    kwargs: dict
    extents: tuple  # bytes the cache, then each input, reach
    fp8: bool
    squeeze: bool  # a 4-D cache: drop its size-1 head dim


_PLANS = HostPlanCache()


def _indexer_host_plan(k, k_cache, slot_mapping) -> _WriteHostPlan:
    check_tensor("k", k, dtype=torch.bfloat16, ndim=2)
    lay = indexer_k_cache_layout(k_cache)
    num_tokens, d = k.shape
    if d != lay.head_dim:
        raise ValueError(f"k has head dim {d} but k_cache holds {lay.head_dim}-dim keys")
    check_slot_mapping(slot_mapping, num_tokens)
    check_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    block_t = 64 if INTERPRETER else 8  # the interpreter pays per program, not per element
    empty = num_tokens == 0 or lay.num_pages == 0
    return _WriteHostPlan(
        grid=None if empty else (cdiv(num_tokens, block_t),),
        ints=(
            num_tokens,
            lay.num_pages * lay.block_size,
            *k.stride(),
            *lay.store_strides(),
        ),  # fmt: skip
        kwargs=dict(
            PAGE=lay.block_size, D=d, DP=next_pow2(d), FP8=lay.fp8, BLOCK_T=block_t, num_warps=4
        ),  # fmt: skip
        extents=tuple(map(byte_extent, (k_cache, k, slot_mapping))),
        fp8=lay.fp8,
        squeeze=k_cache.dim() == 4,
    )


# ---- MLA latent writer ----------------------------------------------------------------------


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
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        _write_mla_latent_op(kv_c, k_pe, kv_cache, slot_mapping)
        return kv_cache
    if _model1.routes_to_model1(kv_c, kv_cache):  # DeepSeek-V4's formats (model1.py)
        return _model1.write_model1_latent(kv_c, k_pe, kv_cache, slot_mapping)
    try:  # the checks read metadata only: done once per key
        key = tuple(map(tensor_meta, (kv_c, k_pe, kv_cache, slot_mapping)))
    except AttributeError:
        key = None
    plan = _PLANS.get(key) or _PLANS.put(key, _mla_host_plan(kv_c, k_pe, kv_cache, slot_mapping))
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
        launch(write._write_mla_kernel, plan.grid, args, plan.kwargs, plan)
    return kv_cache


@custom_op("write_mla_latent", public=write_mla_latent, mutates_args=("kv_cache",))
def _write_mla_latent_op(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    run_eager(write_mla_latent, kv_c, k_pe, kv_cache, slot_mapping)


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


def _mla_host_plan(kv_c, k_pe, kv_cache, slot_mapping) -> _WriteHostPlan:
    check_tensor("kv_c", kv_c, dtype=torch.bfloat16, ndim=2)
    check_tensor("k_pe", k_pe, dtype=torch.bfloat16, ndim=2)
    num_tokens, nope = kv_c.shape
    if k_pe.shape[0] != num_tokens:
        raise ValueError(f"kv_c has {num_tokens} tokens but k_pe has {k_pe.shape[0]}")
    if nope < MLA_TILE or nope % MLA_TILE:
        raise ValueError(f"kv_c must be [T, nope] with nope a multiple of {MLA_TILE}, got {nope}")
    _check_rope_width(k_pe, kv_cache, nope)
    lay = mla_cache_layout(kv_cache, nope, k_pe.shape[1])
    check_slot_mapping(slot_mapping, num_tokens)
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
    return _WriteHostPlan(
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
