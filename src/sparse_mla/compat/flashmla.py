"""FlashMLA's sparse decode entry points, same names and conventions, backed by our kernel.

An engine that calls ``flash_mla.get_mla_metadata`` / ``flash_mla.flash_mla_with_kvcache``
with ``indices=`` (DeepSeek-V3.2 sparse decode) can import these instead. Conventions kept:
q ``[b, s_q, h_q, 576]``, indices ``[b, s_q, topk]`` global slots, out ``[b, s_q, h_q, 512]``,
lse ``[b, h_q, s_q]`` (natural log, ``+inf`` for a row with no valid index), ``attn_sink``,
``topk_length`` per request (``[b]``), the schedule object reused across calls of one shape.

Differences, all widening what is accepted: any ``h_q`` in 1..128 (FlashMLA: 64 or 128 on
Hopper), a bf16 cache with ``is_fp8_kvcache=False``, any ``topk``, ``topk_length`` also as
``[b, s_q]``; bad input raises ``ValueError``/``TypeError`` instead of asserting. Dense
(non-sparse) attention is not provided. The schedule object holds our split workspace, sized
on its first call (outside a CUDA graph, as FlashMLA's schedule is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.attention import AttentionWorkspace, attention_workspace, sparse_mla_decode


@dataclass
class FlashMLASchedMeta:
    """What :func:`get_mla_metadata` returns: filled on the first call (the shape it serves
    and our split workspace), reused by later calls of the same shape."""

    have_initialized: bool = False
    shape: tuple | None = None
    workspace: AttentionWorkspace | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """An empty schedule, as FlashMLA's (arguments accepted and ignored for compatibility)."""
    del args, kwargs
    return FlashMLASchedMeta(), None


def _flat_lengths(topk_length: torch.Tensor | None, b: int, s_q: int) -> torch.Tensor | None:
    if topk_length is None:
        return None
    if topk_length.dim() == 1 and topk_length.shape[0] == b:
        return topk_length.repeat_interleave(s_q) if s_q > 1 else topk_length
    if topk_length.shape == (b, s_q):
        return topk_length.reshape(b * s_q)
    raise ValueError(
        f"topk_length must be [{b}] (per request) or [{b}, {s_q}], got {tuple(topk_length.shape)}"
    )


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse decode: attention of each query row over its ``indices``.

    Args:
        q: bf16 ``[b, s_q, h_q, 576]``.
        k_cache: FlashMLA's fp8 format ``[pages, page, 1, 656]`` (uint8 or float8_e4m3fn
            bytes) with ``is_fp8_kvcache=True``, or bf16 ``[pages, page, 1, 576]`` with False.
        block_table, cache_seqlens: unused by sparse decode (as in FlashMLA).
        head_dim_v: must be 512. tile_scheduler_metadata: from :func:`get_mla_metadata`.
        num_splits: must be None. softmax_scale: default ``576 ** -0.5``. causal: False.
        indices: int32 ``[b, s_q, topk]`` global slots ``page * block_size + offset``, -1 none.
        attn_sink: fp32 ``[h_q]`` or None. topk_length: int32 ``[b]`` or None.
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length: not supported (None).

    Returns:
        out bf16 ``[b, s_q, h_q, 512]`` and lse fp32 ``[b, h_q, s_q]`` (``+inf`` where a row
        has no valid index, FlashMLA's convention; :func:`sparse_mla.sparse_mla_decode` gives
        ``-inf`` there).
    """
    meta = tile_scheduler_metadata
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata must come from get_mla_metadata()")
    if num_splits is not None:
        raise ValueError("num_splits must be None")
    if indices is None:
        raise ValueError("only sparse decode (indices=...) is provided")
    if causal:
        raise ValueError("causal must be False for sparse decode")
    if head_dim_v != 512:
        raise ValueError(f"head_dim_v must be 512, got {head_dim_v}")
    if extra_k_cache is not None or extra_indices_in_kvcache is not None or extra_topk_length:
        raise ValueError("extra_k_cache / extra_indices_in_kvcache are not supported")
    if q.dim() != 4 or indices.dim() != 3:
        raise ValueError(
            f"q must be [b, s_q, h_q, 576] and indices [b, s_q, topk], got {tuple(q.shape)} "
            f"and {tuple(indices.shape)}"
        )
    if k_cache.dtype == torch.float8_e4m3fn:
        k_cache = k_cache.view(torch.uint8)
    if (k_cache.dtype == torch.uint8) != bool(is_fp8_kvcache):
        raise ValueError(
            f"is_fp8_kvcache={is_fp8_kvcache} does not match a k_cache of dtype {k_cache.dtype}"
        )
    b, s_q, h_q, d = q.shape
    topk = indices.shape[-1]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    shape = (b, s_q, h_q, topk, k_cache.dtype)
    if not meta.have_initialized:
        fmt = "fp8" if is_fp8_kvcache else "bf16"
        meta.workspace = attention_workspace(b * s_q, h_q, topk, cache_format=fmt, device=q.device)
        meta.shape, meta.have_initialized = shape, True
    elif meta.shape != shape:
        raise ValueError(
            f"tile_scheduler_metadata was made for (b, s_q, h_q, topk, cache) = {meta.shape}, "
            f"this call has {shape}: use one get_mla_metadata() per shape"
        )
    out, lse = sparse_mla_decode(
        q.reshape(b * s_q, h_q, d),
        k_cache,
        indices.reshape(b * s_q, topk),
        sm_scale=scale,
        topk_length=_flat_lengths(topk_length, b, s_q),
        attn_sink=attn_sink,
        workspace=meta.workspace,
    )
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    return out.view(b, s_q, h_q, 512), lse.view(b, s_q, h_q).transpose(1, 2).contiguous()
