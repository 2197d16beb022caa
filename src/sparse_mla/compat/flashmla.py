"""FlashMLA's sparse entry points (decode, and prefill: :func:`flash_mla_sparse_fwd`), same
names and conventions, backed by our kernel.

An engine that calls ``flash_mla.get_mla_metadata`` / ``flash_mla.flash_mla_with_kvcache``
with ``indices=`` (DeepSeek-V3.2 sparse decode) can import these instead. Conventions kept:
q ``[b, s_q, h_q, 576]``, indices ``[b, s_q, topk]`` global slots, out ``[b, s_q, h_q, 512]``,
lse ``[b, h_q, s_q]`` (natural log, ``+inf`` for a row with no valid index; FlashMLA's
strides: the transposed view of a ``[b, s_q, h_q]`` buffer), ``attn_sink``, ``topk_length``
per request (``[b]``), the schedule object (:class:`FlashMLASchedMeta`, FlashMLA's fields)
reused across calls of one shape. Arguments are checked once per argument metadata (host
cost), as the library's own wrappers do.

DeepSeek-V4 ("MODEL1", ``d_qk`` 512): q ``[b, s_q, h_q, 512]``, caches in FlashMLA's MODEL1
fp8 format (``[pages, page, 1, 584]``, as ``new_mla_cache(format="model1_fp8")`` makes them),
and the second set ``extra_k_cache`` + ``extra_indices_in_kvcache`` (+ ``extra_topk_length``)
attended in the same softmax, as FlashMLA takes them.

Differences, all widening what is accepted: any ``h_q`` in 1..128 (FlashMLA: 64 or 128 on
Hopper), a bf16 cache with ``is_fp8_kvcache=False`` (MODEL1: 512-wide bf16 rows), any
``topk``, ``topk_length`` / ``extra_topk_length`` also as ``[b, s_q]`` and with any strides,
every id outside a cache masked (FlashMLA masks -1 only); bad input raises
``ValueError``/``TypeError`` naming the argument instead of asserting. Not provided: dense
(non-sparse) attention. The schedule object holds our split workspace, sized on its first
call (outside a CUDA graph, as FlashMLA's schedule is).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch

from .._checks import check_int, check_tensor
from .._launch import HostPlanCache, scalars_key, tensor_meta
from ..ops.attention import AttentionWorkspace, attention_workspace, sparse_mla_decode

LATENT_DIM, HEAD_DIM_V = 576, 512
_CHECKED = HostPlanCache()  # argument metadata that passed the checks -> the call's Config


@dataclass
class FlashMLASchedMeta:
    """What :func:`get_mla_metadata` returns, with FlashMLA's public fields.

    * ``have_initialized``: set by the first :func:`flash_mla_with_kvcache` call.
    * ``config``: a :class:`FlashMLASchedMeta.Config` of that call's shapes and flags, as
      FlashMLA fills it (None before); later calls must match it.
    * ``tile_scheduler_metadata``, ``num_splits``: FlashMLA's tile-scheduler tensors. We have
      no tile scheduler, so they stay None after every call (our split plan is the
      workspace); code that only passes them along keeps working.
    * ``workspace``: ours, the attention's split workspace sized on the first call.
    """

    @dataclass
    class Config:
        """The first call's shapes and flags (FlashMLA's fields; ``extra_*`` always None)."""

        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None
    workspace: AttentionWorkspace | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """An empty schedule, as FlashMLA's (arguments accepted and ignored for compatibility)."""
    del args, kwargs
    return FlashMLASchedMeta(), None


def _flat_lengths(topk_length: torch.Tensor | None, b: int, s_q: int) -> torch.Tensor | None:
    """``topk_length`` per query row ``[b * s_q]`` (a view where possible; strides kept)."""
    if topk_length is None:
        return None
    if topk_length.dim() == 1:
        return topk_length.repeat_interleave(s_q) if s_q > 1 else topk_length
    return topk_length.reshape(b * s_q)


def _check_flags(
    head_dim_v: object, num_splits: object, softmax_scale: object, causal: object,
    is_fp8_kvcache: object,
) -> None:  # fmt: skip
    """The host arguments FlashMLA asserts on."""
    if check_int("head_dim_v", head_dim_v) != HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {HEAD_DIM_V}, got {head_dim_v}")
    if num_splits is not None:
        raise ValueError(f"num_splits must be None (FlashMLA's placeholder), got {num_splits!r}")
    for name, flag in (("causal", causal), ("is_fp8_kvcache", is_fp8_kvcache)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if causal:
        raise ValueError("causal must be False for sparse decode (indices given)")
    scale_ok = isinstance(softmax_scale, Real) and not isinstance(softmax_scale, bool)
    if softmax_scale is not None and not scale_ok:
        kind = type(softmax_scale).__name__
        raise TypeError(f"softmax_scale must be a float or None, got {kind}")


def _check_tensors(
    q: object, k_cache: object, indices: object, topk_length: object, attn_sink: object,
    is_fp8_kvcache: bool,
) -> None:  # fmt: skip
    """Shapes, dtypes and devices, named as FlashMLA names the arguments."""
    if indices is None:
        raise ValueError("indices is required: only sparse decode (indices=...) is provided")
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4)
    b, s_q, h_q, d = q.shape
    if d not in (LATENT_DIM, HEAD_DIM_V):
        raise ValueError(
            f"q must be [b, s_q, h_q, {LATENT_DIM}] (V3.2) or [b, s_q, h_q, {HEAD_DIM_V}] "
            f"(MODEL1), got {tuple(q.shape)}"
        )
    dev = q.device
    _check_cache("k_cache", k_cache, is_fp8_kvcache, dev)
    _check_ids("indices", indices, b, s_q, dev)
    _check_lengths("topk_length", topk_length, b, s_q, dev)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, ndim=1, device=dev)
        if attn_sink.shape[0] != h_q:
            raise ValueError(f"attn_sink must be [h_q] = [{h_q}], got {tuple(attn_sink.shape)}")


def _check_cache(name: str, cache: object, is_fp8_kvcache: bool, dev: torch.device) -> None:
    """A cache tensor of FlashMLA's form (its byte layout is checked by the library)."""
    check_tensor(name, cache, dtype=(torch.uint8, torch.int8, torch.float8_e4m3fn, torch.bfloat16),
                 device=dev)  # fmt: skip
    if cache.dim() not in (3, 4) or (cache.dim() == 4 and cache.shape[2] != 1):
        raise ValueError(f"{name} must be [pages, page, 1, bytes] (h_k = 1) or [pages, page, "
                         f"bytes], got {tuple(cache.shape)}")  # fmt: skip
    if (cache.dtype != torch.bfloat16) != is_fp8_kvcache:
        raise ValueError(
            f"is_fp8_kvcache={is_fp8_kvcache} does not match {name}'s dtype {cache.dtype}"
        )


def _check_ids(name: str, ids: object, b: int, s_q: int, dev: torch.device) -> None:
    check_tensor(name, ids, dtype=torch.int32, ndim=3, device=dev)
    if ids.shape[:2] != (b, s_q):
        got = tuple(ids.shape)
        raise ValueError(f"{name} must be [b, s_q, topk] with b={b}, s_q={s_q} as q, got {got}")


def _check_lengths(name: str, lengths: object, b: int, s_q: int, dev: torch.device) -> None:
    if lengths is not None:
        check_tensor(name, lengths, dtype=torch.int32, device=dev)
        if lengths.shape not in ((b,), (b, s_q)):
            raise ValueError(
                f"{name} must be [{b}] (per request) or [{b}, {s_q}], got {tuple(lengths.shape)}"
            )


def _check_extras(q: torch.Tensor, cache: object, ids: object, lengths: object,
                  is_fp8_kvcache: bool) -> None:  # fmt: skip
    """DeepSeek-V4's second set, as FlashMLA requires it: all three or the cache and ids."""
    if cache is None:
        for name, value in (("extra_indices_in_kvcache", ids), ("extra_topk_length", lengths)):
            if value is not None:
                raise ValueError(f"{name} must not be provided when extra_k_cache is not")
        return
    if ids is None:
        raise ValueError("extra_indices_in_kvcache must be provided with extra_k_cache")
    b, s_q = q.shape[:2]
    _check_cache("extra_k_cache", cache, is_fp8_kvcache, q.device)
    _check_ids("extra_indices_in_kvcache", ids, b, s_q, q.device)
    _check_lengths("extra_topk_length", lengths, b, s_q, q.device)


def _call_config(
    q: torch.Tensor, k_cache: torch.Tensor, topk: int, fp8: bool,
    extra_k_cache: torch.Tensor | None, extra_ids: torch.Tensor | None,
) -> FlashMLASchedMeta.Config:  # fmt: skip
    """The call's shapes and flags as FlashMLA records them in its schedule."""
    b, s_q, h_q, _ = q.shape
    h_k = k_cache.shape[2] if k_cache.dim() == 4 else 1
    extra = (None, None) if extra_k_cache is None else (extra_k_cache.shape[1], extra_ids.shape[-1])
    return FlashMLASchedMeta.Config(b, s_q, h_q, k_cache.shape[1], h_k, False, fp8, topk,
                                    *extra)  # fmt: skip


EXTRAS = ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")


def _checked_config(args: dict) -> FlashMLASchedMeta.Config:
    """Check the call (once per argument metadata: host cost) and return its Config."""
    tensors = ("q", "k_cache", "indices", "topk_length", "attn_sink")
    flags = ("head_dim_v", "num_splits", "softmax_scale", "causal", "is_fp8_kvcache")
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = (tuple(tensor_meta(args[n]) for n in (*tensors, *EXTRAS)),
                   scalars_key(*(args[n] for n in flags)))  # fmt: skip
        except AttributeError:  # a non-tensor where a tensor belongs: the checks say which
            key = None
    config = _CHECKED.get(key)
    if config is None:
        _check_flags(*(args[n] for n in flags))
        _check_tensors(*(args[n] for n in tensors), args["is_fp8_kvcache"])
        _check_extras(args["q"], *(args[n] for n in EXTRAS), args["is_fp8_kvcache"])
        config = _call_config(args["q"], args["k_cache"], args["indices"].shape[-1],
                              args["is_fp8_kvcache"], args["extra_k_cache"],
                              args["extra_indices_in_kvcache"])  # fmt: skip
        _CHECKED.put(key, config)
    return config


def _schedule(meta: object, config: FlashMLASchedMeta.Config, device: torch.device) -> None:
    """Fill ``meta`` on its first call (config, workspace); check later calls against it."""
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(
            f"tile_scheduler_metadata must come from get_mla_metadata(), got {type(meta).__name__}"
        )
    if not meta.have_initialized:
        fmt = "fp8" if config.is_fp8_kvcache else "bf16"
        topk = config.topk + (config.extra_topk or 0)  # the columns the splits cut
        meta.workspace = attention_workspace(config.b * config.s_q, config.h_q, topk,
                                             cache_format=fmt, device=device)  # fmt: skip
        meta.config, meta.have_initialized = config, True
    elif meta.config is not config and meta.config != config:
        raise ValueError(
            f"tile_scheduler_metadata was made for {meta.config}, this call has {config}: use "
            "one get_mla_metadata() per shape"
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
        q: bf16 ``[b, s_q, h_q, 576]`` (V3.2) or ``[b, s_q, h_q, 512]`` (DeepSeek-V4, MODEL1).
        k_cache: FlashMLA's fp8 format ``[pages, page, 1, 656]`` (uint8, int8 or
            float8_e4m3fn bytes) with ``is_fp8_kvcache=True``, or bf16 ``[pages, page, 1,
            576]`` with False (the size-1 dim may be left out); for MODEL1 its fp8 format
            ``[pages, page, 1, 584]`` (``new_mla_cache(format="model1_fp8")``) or bf16
            ``[pages, page, 1, 512]``.
        block_table, cache_seqlens: unused by sparse decode (as in FlashMLA).
        head_dim_v: must be 512. tile_scheduler_metadata: from :func:`get_mla_metadata`.
        num_splits: must be None. softmax_scale: default ``576 ** -0.5``. causal: False.
        is_fp8_kvcache: bool, must match ``k_cache``'s dtype.
        indices: int32 ``[b, s_q, topk]`` global slots ``page * block_size + offset``, -1 none.
        attn_sink: fp32 ``[h_q]`` or None (any stride).
        topk_length: int32 ``[b]`` (each request's rows read their first ``topk_length[b]``
            indices) or ``[b, s_q]`` (per row), any strides, or None.
        extra_k_cache, extra_indices_in_kvcache ``[b, s_q, extra_topk]``, extra_topk_length
            (``[b]`` or ``[b, s_q]``): DeepSeek-V4's second set (compressed entries), in
            ``k_cache``'s format (any page size), attended in the same softmax; ids and
            lengths with the rules of ``indices`` / ``topk_length``.

    Returns:
        out bf16 ``[b, s_q, h_q, 512]`` and lse fp32 ``[b, h_q, s_q]`` (``+inf`` where a row
        has no valid index, FlashMLA's convention; :func:`sparse_mla.sparse_mla_decode` gives
        ``-inf`` there). lse has FlashMLA's strides ``(s_q * h_q, 1, h_q)``: the transposed
        view of a ``[b, s_q, h_q]`` buffer.
    """
    args = {"q": q, "k_cache": k_cache, "indices": indices, "topk_length": topk_length,
            "attn_sink": attn_sink, "head_dim_v": head_dim_v, "num_splits": num_splits,
            "softmax_scale": softmax_scale, "causal": causal, "is_fp8_kvcache": is_fp8_kvcache,
            "extra_k_cache": extra_k_cache, "extra_indices_in_kvcache": extra_indices_in_kvcache,
            "extra_topk_length": extra_topk_length}  # fmt: skip
    _schedule(tile_scheduler_metadata, _checked_config(args), q.device)
    b, s_q, h_q, d = q.shape
    topk = indices.shape[-1]
    extra = {}
    if extra_k_cache is not None:  # DeepSeek-V4's second set
        extra = dict(
            extra_kv_cache=_bytes(extra_k_cache),
            extra_indices=extra_indices_in_kvcache.reshape(b * s_q, -1),
            extra_topk_length=_flat_lengths(extra_topk_length, b, s_q),
        )
    out, lse = sparse_mla_decode(
        q.reshape(b * s_q, h_q, d),
        _bytes(k_cache),
        indices.reshape(b * s_q, topk),
        sm_scale=d**-0.5 if softmax_scale is None else float(softmax_scale),
        topk_length=_flat_lengths(topk_length, b, s_q),
        attn_sink=attn_sink,
        workspace=tile_scheduler_metadata.workspace,
        **extra,
    )
    lse.masked_fill_(torch.isneginf(lse), float("inf"))  # FlashMLA's empty row: +inf
    # FlashMLA's layout: a [b, h_q, s_q] view of a [b, s_q, h_q] buffer (vLLM's DCP merge
    # reads it as such), not a contiguous copy.
    return out.view(b, s_q, h_q, HEAD_DIM_V), lse.view(b, s_q, h_q).transpose(1, 2)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as the uint8 bytes the library takes (FlashMLA takes int8 and float8 too)."""
    return cache.view(torch.uint8) if cache.dtype in (torch.int8, torch.float8_e4m3fn) else cache


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = HEAD_DIM_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse prefill: attention of each query row over its ``indices`` into one
    bf16 latent array (our decode kernel over ``kv`` read as a cache of one-row pages).
    DeepSeek-V3.2 (d_qk 576: 512 latent + 64 rope) or V4 (d_qk 512: the row is key and
    value, RoPE dims included).

    Args:
        q: bf16 ``[s_q, h_q, d_qk]``, d_qk 576 or 512 (any ``h_q`` in 1..128; FlashMLA: 64 or
            128 on Hopper).
        kv: bf16 ``[s_kv, 1, d_qk]`` (h_kv = 1), rows 16-byte aligned for the Hopper kernel
            (else the portable one runs).
        indices: int32 ``[s_q, 1, topk]`` rows of ``kv``; -1, any other negative value and
            values ``>= s_kv`` are invalid (skipped, never read).
        sm_scale: softmax scale. d_v: must be 512.
        attn_sink: fp32 ``[h_q]`` or None: out scaled by ``exp(lse) / (exp(lse) +
            exp(sink))`` (lse and max_logits unchanged).
        topk_length: int32 ``[s_q]`` or None: row t reads only its first ``topk_length[t]``
            indices.

    Returns:
        out bf16 ``[s_q, h_q, 512]`` (0 for a row with no valid index), max_logits fp32
        ``[s_q, h_q]`` (the largest ``sm_scale * q . k``; ``-inf`` for such a row) and lse
        fp32 ``[s_q, h_q]`` (natural log; ``+inf`` for such a row), as FlashMLA's.
    """
    if check_int("d_v", d_v) != HEAD_DIM_V:
        raise ValueError(f"d_v must be {HEAD_DIM_V}, got {d_v}")
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    s_q, h_q, _ = q.shape
    d_qk = q.shape[2]
    if d_qk not in (LATENT_DIM, HEAD_DIM_V):
        raise ValueError(
            f"q must be [s_q, h_q, {LATENT_DIM}] (V3.2) or [s_q, h_q, {HEAD_DIM_V}] (V4), got "
            f"{tuple(q.shape)}"
        )
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=3, device=q.device)
    if kv.shape[1:] != (1, d_qk):
        raise ValueError(
            f"kv must be [s_kv, 1, {d_qk}] (h_kv = 1, q's head dim), got {tuple(kv.shape)}"
        )
    check_tensor("indices", indices, dtype=torch.int32, ndim=3, device=q.device)
    if indices.shape[:2] != (s_q, 1):
        got = tuple(indices.shape)
        raise ValueError(f"indices must be [s_q, 1, topk] with s_q={s_q} as q, got {got}")
    scale_ok = isinstance(sm_scale, Real) and not isinstance(sm_scale, bool)
    if not scale_ok:
        raise TypeError(f"sm_scale must be a float, got {type(sm_scale).__name__}")
    max_logits = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    out, lse = sparse_mla_decode(
        q, kv, indices[:, 0], sm_scale=float(sm_scale), topk_length=topk_length,
        attn_sink=attn_sink, max_logits=max_logits,
    )  # fmt: skip
    lse.masked_fill_(torch.isneginf(lse), float("inf"))  # FlashMLA's empty row: +inf
    return out, max_logits, lse
