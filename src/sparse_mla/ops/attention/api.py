"""Host side of the sparse MLA decode: checks, workspace, config choice and the launches."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import torch
import triton

from ..._checks import (
    check_int,
    check_offsets_fit_int32,
    check_output,
    check_same_device,
    check_shape,
    check_tensor,
)
from ..._custom_op import compiling, custom_op, decode_config, encode_config, run_eager
from ..._launch import (
    HostPlanCache,
    byte_extent,
    check_disjoint,
    launch,
    scalars_key,
    tensor_meta,
    value_key,
)
from ..._runtime import (
    INTERPRETER,
    canonical_device,
    e4m3_bits,
    next_pow2,
    num_sms,
    pdl_launch,
)
from . import combine, split_kv  # kernels looked up on their modules (tests/kernel_compile.py)
from .config import (
    MAX_HEADS,
    AttentionConfig,
    check_attention_config,
    choose_attention_config,
    workspace_rows,
)
from .extra import (
    EXTRA_NAMES,
    NO_EXTRA_INTS,
    ExtraPlan,
    cache_layout,
    check_extra,
    extra_tensors,
    kv_strides,
    word_view,
)
from .split_kv import LOG2E, NOPE, ROPE

HEAD_DIM = NOPE + ROPE
MODEL1_HEAD_DIM = 512  # DeepSeek-V4 (MODEL1 caches): 448 + 64 rope, K = V
INT32_MAX = 2**31 - 1
# "SMs" the launch-shape choice assumes under the interpreter: small calls still split.
INTERPRETER_SMS = 4
# Partial-output values one combine program loads at once (32 registers a thread at 4 warps).
COMBINE_TILE = 4096


@dataclass(frozen=True)
class AttentionWorkspace:
    """Split scratch of :func:`sparse_mla_decode`, sized once so a CUDA graph allocates nothing.

    partial_out: fp32 ``[rows, h_q, 512]``, each split's normalised partial output.
    partial_lse: fp32 ``[rows, h_q]``, each split's base-2 log-sum-exp.
    ``rows`` covers ``T * splits`` of every call it was sized for.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @property
    def rows(self) -> int:
        return self.partial_lse.shape[0]


# The Triton releases whose Gluon the sm90 kernel is written and compile-checked for.
SM90_TRITON = ((3, 6), (3, 9))


def _sm90_kernel():
    """The Gluon kernel module, or None where this Triton's Gluon is not one it was written
    for (imported on first use: Gluon is experimental and its import costs time)."""
    version = tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2])
    if not SM90_TRITON[0] <= version <= SM90_TRITON[1]:
        return None
    try:
        from . import decode_sm90
    except Exception:  # noqa: BLE001  (any failure of an experimental API: use the Triton kernel)
        return None
    return decode_sm90


@functools.cache
def sm90_available(device: torch.device) -> bool:
    """Whether the Gluon kernel can run on ``device``: an sm_90 NVIDIA GPU (not the
    interpreter) and a Triton in ``SM90_TRITON`` whose Gluon it compiles with."""
    if INTERPRETER or device.type != "cuda" or torch.version.hip:
        return False
    if torch.cuda.get_device_capability(canonical_device(device)) != (9, 0):
        return False
    return _sm90_kernel() is not None


def _sms(device: torch.device) -> int:
    return num_sms(device, interpreter=INTERPRETER_SMS)


def attention_workspace(
    num_tokens: int,
    h_q: int,
    topk: int = 2048,
    *,
    cache_format: str = "fp8",
    config: AttentionConfig | None = None,
    device: torch.device | str | None = None,
) -> AttentionWorkspace:
    """Pre-sized split scratch for :func:`sparse_mla_decode` calls of up to ``num_tokens``
    query rows with ``h_q`` heads and ``topk`` columns on a ``cache_format`` cache ("bf16" or
    "fp8"), under the default launch shapes or under a fixed ``config`` (checked as the call
    checks it). Its contents need no initialisation."""
    check_int("num_tokens", num_tokens, lo=0)
    check_int("h_q", h_q, lo=1, hi=MAX_HEADS)
    check_int("topk", topk, lo=1)
    dev = canonical_device(device)
    if config is not None:
        splits = check_attention_config(config).effective_splits(topk)
        rows = num_tokens * splits if splits > 1 else 0
    else:
        # Either kernel may take a call (the sm90 one not on every cache): room for both.
        rows = max(
            workspace_rows(num_tokens, h_q, topk, cache_format, _sms(dev), sm90=sm90)
            for sm90 in {False, sm90_available(dev)}
        )
    return AttentionWorkspace(
        torch.empty((rows, h_q, NOPE), dtype=torch.float32, device=dev),
        torch.empty((rows, h_q), dtype=torch.float32, device=dev),
    )


def _check_fused(block_table, req_id, block_size, num_tokens, cache_block_size, dev):
    if (block_table is None) != (req_id is None):
        raise ValueError("block_table and req_id go together: pass both (fused remap) or neither")
    if block_table is None:
        if block_size is not None:
            raise ValueError("block_size is only used with block_table and req_id")
        return None
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    check_tensor("req_id", req_id, dtype=torch.int32, ndim=1, device=dev)
    check_shape("req_id", req_id, (num_tokens,))
    bs = cache_block_size if block_size is None else check_int("block_size", block_size, lo=1)
    return bs


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    block_table: torch.Tensor | None = None,
    req_id: torch.Tensor | None = None,
    block_size: int | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None,
    config: AttentionConfig | None = None,
    max_logits: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    extra_block_table: torch.Tensor | None = None,
    extra_block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention (DeepSeek-V3.2 DSA, DeepSeek-V4) over the selected cache rows.

    ``s_j = sm_scale * q[t, h] . kv[slot_j]`` (576 dims), softmax in fp32 over the valid
    entries j of row t, ``out[t, h] = sum_j p_j kv[slot_j, :512]``, ``lse = logsumexp_j s_j``.
    DeepSeek-V4 (a MODEL1 cache): 512-wide rows that are key and value alike, ``s_j = sm_scale
    * q[t, h] . kv[slot_j]`` and ``out = sum_j p_j kv[slot_j]`` over all 512 dims.

    Args:
        q: bf16 ``[T, h_q, 576]`` (``[T, h_q, 512]`` with a MODEL1 cache), any strides, any
            ``h_q`` in 1..128 (no padding needed).
        kv_cache: bf16 ``[P, page, 576]`` (or ``[P, page, 1, 576]``), or FlashMLA's fp8 format,
            uint8 ``[P, page, 1, 656]`` (or ``[P, page, 656]``: 512 e4m3 | 4 fp32 scales, one
            per 128 values, any finite positive values | 64 bf16 rope), as ``new_mla_cache``;
            or a MODEL1 cache (``new_mla_cache(format="model1_fp8" | "model1_bf16")``:
            ``sparse_mla.ops.kv_cache.model1``; fp8: even page stride and storage offset).
        indices: int32 ``[T, topk]`` (any ``topk >= 1``; 2048 is the model's): global slots
            ``page * block_size + offset``, or, with ``block_table`` and ``req_id``,
            request-local positions. -1 is no entry. Device data is not trusted: a slot
            outside ``[0, P * page)``, any other negative value, a position whose block-table
            column is past the table or holds a negative page id, and a ``req_id`` outside
            ``[0, R)`` are invalid entries (skipped, never read).
        sm_scale: softmax scale (V3.2: 0.1352...).
        block_table: int32 ``[R, W]`` page ids (fused remap; with ``req_id``).
        req_id: int32 ``[T]`` (any stride, as every 1-D input): the block-table row of each
            query row.
        block_size: positions per block-table page (default: the cache's page size); the slot
            of position p is ``block_table[req, p // block_size] * block_size +
            p % block_size``, exactly as :func:`convert_req_index_to_global_index`.
        topk_length: int32 ``[T]`` or None: row t reads only its first ``n`` entries, ``n``
            clamped to ``[0, topk]``.
        attn_sink: fp32 ``[h_q]`` or None: out is scaled by ``exp(lse) / (exp(lse) +
            exp(sink))`` (lse unchanged; +inf gives 0, -inf leaves out as is).
        out: optional bf16 ``[T, h_q, 512]`` to write into (any strides, no broadcast view).
        lse: optional fp32 ``[T, h_q]`` to write into. ``out``, ``lse`` and the workspace
            must share no memory with each other or with any input (checked: ValueError).
        workspace: split scratch from :func:`attention_workspace` (allocated per call when
            None and the call splits); pass one to capture the call in a CUDA graph.
        config: launch shape (default :func:`choose_attention_config`).
        max_logits: optional contiguous fp32 ``[T, h_q]``: also write each row's largest
            score ``max_j s_j`` into it (``-inf`` for a row with no valid entry; unspecified
            where lse is NaN), as FlashMLA's sparse prefill returns it. The call then runs
            unsplit (a ``config`` that splits is refused: ValueError).
        extra_kv_cache, extra_indices, extra_topk_length, extra_block_table,
        extra_block_size: DeepSeek-V4's second index set, attended in the same softmax
            (FlashMLA's ``extra_k_cache`` / ``extra_indices_in_kvcache`` /
            ``extra_topk_length``): a cache of ``kv_cache``'s format (any page size), int32
            ``[T, topk2]`` ids with the rules of ``indices`` (with the fused remap: positions
            through ``extra_block_table`` ``[R2, W2]``, the same ``req_id``, pages of
            ``extra_block_size``, default its page size), int32 ``[T]`` valid counts.
            Splits cut the concatenated columns (``topk + topk2``). The portable kernel
            only, eagerly (not yet a custom-op argument).

    Returns:
        (out bf16 ``[T, h_q, 512]``, lse fp32 ``[T, h_q]``, natural log). A row with no valid
        entry gives out 0 and lse ``-inf`` (FlashMLA gives +inf there; -inf is what a DCP
        merge takes as is: such a rank weighs 0). Deterministic: the splits are merged in a
        fixed order, so repeated calls give bitwise identical results.

    Non-finite scores (per row and head, over its valid entries; split or not alike):
        * a NaN or ``+inf`` score (NaN in ``q`` or in a selected cache row, ``sm_scale`` NaN
          or infinite, an fp32 overflow of ``q . k``) gives out NaN and lse NaN, never the
          ``-inf`` of an empty row;
        * ``-inf`` scores weigh 0; a row whose valid scores are all ``-inf`` is an empty row
          (out 0, lse ``-inf``);
        * NaN only in entries that are not valid (masked, past ``topk_length``) is never
          read and changes nothing. A NaN ``attn_sink`` makes that head's out NaN (lse
          unchanged). Infinite values in a selected cache row can make out NaN (0 * inf)
          with a finite lse.
    """
    extras = (extra_kv_cache, extra_indices, extra_topk_length, extra_block_table)
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        out = _empty_out(q) if out is None else out
        lse = _empty_lse(q) if lse is None else lse
        ws = (None, None) if workspace is None else (workspace.partial_out, workspace.partial_lse)
        _sparse_mla_decode_op(
            q, kv_cache, indices, float(sm_scale), block_table, req_id, block_size, topk_length,
            attn_sink, out, lse, *ws, encode_config(config), max_logits, *extras,
            extra_block_size,
        )  # fmt: skip
        return out, lse
    try:  # the checks and the choices depend on this key only
        ws = (None, None) if workspace is None else (workspace.partial_out, workspace.partial_lse)
        tensors = (q, kv_cache, indices, block_table, req_id, topk_length, attn_sink, out, lse,
                   max_logits, *extras)  # fmt: skip
        key = (
            *map(tensor_meta, (*tensors, *ws)),
            type(workspace),
            kv_cache.data_ptr() % 16,  # the sm90 kernel's 16-byte copies need it
            None if extra_kv_cache is None else extra_kv_cache.data_ptr() % 16,
            scalars_key(type(sm_scale), block_size, extra_block_size),
            value_key(config),
        )
    except AttributeError:  # not a tensor (or not a workspace): the checks say what is wrong
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _host_plan(q, kv_cache, indices, sm_scale, block_table, req_id,
                                     block_size, topk_length, attn_sink, out, lse, workspace,
                                     config, max_logits, extras, extra_block_size))  # fmt: skip
    # Addresses are not in the key: checked on every call.
    _check_disjoint(plan, (q, kv_cache, indices, block_table, req_id, topk_length, attn_sink,
                           *extras), out, lse, workspace, max_logits)  # fmt: skip
    num_tokens, h_q, _ = q.shape
    dev = q.device
    out = _empty_out(q) if out is None else out
    lse = _empty_lse(q) if lse is None else lse
    if num_tokens == 0:
        return out, lse
    cfg = plan.config
    if plan.splits > 1 and workspace is None:
        workspace = attention_workspace(
            num_tokens, h_q, plan.topk, cache_format=plan.fmt, config=cfg, device=dev
        )
    c3 = kv_cache[:, :, 0, :] if kv_cache.dim() == 4 else kv_cache
    _launch(q, c3, plan, indices, block_table, req_id, topk_length, attn_sink, out, lse,
            workspace, float(sm_scale), max_logits, extras)  # fmt: skip
    return out, lse


@custom_op(
    "sparse_mla_decode",
    public=sparse_mla_decode,
    mutates_args=("out", "lse", "partial_out", "partial_lse", "max_logits"),
    represents={"workspace": ("partial_out", "partial_lse")},
)
def _sparse_mla_decode_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    block_table: torch.Tensor | None,
    req_id: torch.Tensor | None,
    block_size: int | None,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    partial_out: torch.Tensor | None,
    partial_lse: torch.Tensor | None,
    config: str | None,
    max_logits: torch.Tensor | None,
    extra_kv_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    extra_block_table: torch.Tensor | None,
    extra_block_size: int | None,
) -> None:
    ws = None if partial_out is None else AttentionWorkspace(partial_out, partial_lse)
    run_eager(
        sparse_mla_decode, q, kv_cache, indices, sm_scale=sm_scale, block_table=block_table,
        req_id=req_id, block_size=block_size, topk_length=topk_length, attn_sink=attn_sink,
        out=out, lse=lse, workspace=ws, config=decode_config(config, AttentionConfig),
        max_logits=max_logits, extra_kv_cache=extra_kv_cache,
        extra_indices=extra_indices, extra_topk_length=extra_topk_length,
        extra_block_table=extra_block_table, extra_block_size=extra_block_size,
    )  # fmt: skip


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    return torch.empty((*q.shape[:2], NOPE), dtype=torch.bfloat16, device=q.device)


def _empty_lse(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)


_PLANS = HostPlanCache()


@dataclass(frozen=True, eq=False)  # hashed by identity: the cached launch's key
class _AttnHostPlan:
    """What a decode call decides from its arguments' metadata."""

    config: AttentionConfig
    splits: int
    fmt: str
    # (grid, the integer arguments after the tensors, keywords) of the main kernel and of the
    # combine (None without splits): fixed by the metadata, so built once per plan.
    main: tuple
    combine: tuple | None
    # bytes each reaches: the inputs (_INPUTS), out, lse, the workspace's two, max_logits
    extents: tuple
    model1: bool = False  # a MODEL1 cache (DeepSeek-V4 rows)
    topk: int = 0  # the columns the splits cut: topk, plus topk2 with a second set


def _host_plan(q, kv_cache, indices, sm_scale, block_table, req_id, block_size, topk_length,
          attn_sink, out, lse, workspace, config, max_logits, extras=(None,) * 4,
          extra_block_size=None) -> _AttnHostPlan:  # fmt: skip
    """Checks every argument of :func:`sparse_mla_decode` and picks its launch shape."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    num_tokens, h_q, dim = q.shape
    lay, model1 = cache_layout(kv_cache)
    if model1 and dim != MODEL1_HEAD_DIM:
        raise ValueError(f"q must have head dim {MODEL1_HEAD_DIM} (a MODEL1 kv_cache: 448 + 64 "
                         f"rope, K = V), got {dim}")  # fmt: skip
    if not model1 and dim != HEAD_DIM:
        raise ValueError(f"q must have head dim {HEAD_DIM} (512 nope + 64 rope), got {dim}")
    if not 1 <= h_q <= MAX_HEADS:
        raise ValueError(f"q must have 1..{MAX_HEADS} heads, got {h_q}")
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if indices.shape[0] != num_tokens:
        raise ValueError(f"indices has {indices.shape[0]} rows but q has {num_tokens} tokens")
    topk = indices.shape[1]
    if topk < 1:
        raise ValueError("indices must have at least one column")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float, got {type(sm_scale).__name__}")
    dev = check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    bs = _check_fused(block_table, req_id, block_size, num_tokens, lay.block_size, dev)
    extra = check_extra(kv_cache, num_tokens, bs is not None, extras, extra_block_size, dev)
    topk_all = topk + (extra.topk if extra is not None else 0)  # the columns splits cut
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, ndim=1, device=dev)
        check_shape("topk_length", topk_length, (num_tokens,))
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, ndim=1, device=dev)
        check_shape("attn_sink", attn_sink, (h_q,))
        check_offsets_fit_int32("attn_sink", attn_sink)  # heads * stride: 32-bit
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, device=dev)
        check_output("out", out, (num_tokens, h_q, NOPE))
    if lse is not None:
        check_tensor("lse", lse, dtype=torch.float32, device=dev)
        check_output("lse", lse, (num_tokens, h_q))
    if max_logits is not None:
        check_tensor("max_logits", max_logits, dtype=torch.float32, device=dev)
        check_shape("max_logits", max_logits, (num_tokens, h_q))
        if not max_logits.is_contiguous():
            raise ValueError("max_logits must be contiguous")
    fmt = "fp8" if lay.fp8 else "bf16"
    caches = (kv_cache,) if extra is None else (kv_cache, extras[0])
    if config is None:
        sm90 = sm90_available(dev) and all(_sm90_fits(c, lay.fp8, model1) for c in caches)
        cfg = choose_attention_config(num_tokens, h_q, topk_all, fmt, _sms(dev), sm90=sm90)
        if max_logits is not None:
            cfg = dataclasses.replace(cfg, num_splits=1)
    else:
        cfg = check_attention_config(config)
        if max_logits is not None and cfg.effective_splits(topk_all) > 1:
            raise ValueError(f"max_logits needs an unsplit launch; config splits: {cfg}")
    if cfg.kernel == "sm90":
        _check_sm90(cfg, dev, caches, lay.fp8, model1)
    splits = cfg.effective_splits(topk_all)
    if workspace is not None and not isinstance(workspace, AttentionWorkspace):
        # (checked even when this call does not split: the next one may)
        raise TypeError(
            f"workspace must come from attention_workspace, got {type(workspace).__name__}"
        )
    if num_tokens and splits > 1 and workspace is not None:
        _check_workspace(workspace, num_tokens * splits, h_q, dev)
    out_s = out.stride() if out is not None else (h_q * NOPE, NOPE, 1)  # made contiguous
    lse_s = lse.stride() if lse is not None else (h_q, 1)
    aligned = all(_aligned16(c[:, :, 0, :] if c.dim() == 4 else c) for c in caches)
    main, comb = _launch_shapes(
        cfg, splits, bs, lay, q, indices, block_table, req_id, topk_length, attn_sink, out_s,
        lse_s, max_logits is not None, extra, topk_all, aligned,
    )  # fmt: skip
    tensors = (q, kv_cache, indices, block_table, req_id, topk_length, attn_sink, *extras, out,
               lse)  # fmt: skip
    ws = (workspace.partial_out, workspace.partial_lse) if workspace is not None else (None,) * 2
    extents = tuple(map(byte_extent, (*tensors, *ws, max_logits)))
    return _AttnHostPlan(cfg, splits, fmt, main, comb, extents, model1, topk_all)


_INPUTS = ("q", "kv_cache", "indices", "block_table", "req_id", "topk_length", "attn_sink",
           *EXTRA_NAMES)  # fmt: skip


def _check_disjoint(plan, inputs, out, lse, workspace, max_logits) -> None:
    """The memory a call writes (out, lse, max_logits; with splits the workspace) shares no
    byte with what it reads or with each other (ValueError naming both)."""
    n = len(_INPUTS)
    out_ext, lse_ext, po_ext, pl_ext, max_ext = plan.extents[n:]  # (the plan's order)
    named = tuple(zip(_INPUTS, inputs, plan.extents[:n], strict=True))
    if workspace is not None and plan.combine is not None:
        ws = (("workspace.partial_out", workspace.partial_out, po_ext),
              ("workspace.partial_lse", workspace.partial_lse, pl_ext))  # fmt: skip
        check_disjoint(*ws[0], (*named, ws[1]))
        check_disjoint(*ws[1], named)
        named += ws
    if out is not None:
        check_disjoint("out", out, out_ext, (*named, ("lse", lse, lse_ext)))
    if lse is not None:
        check_disjoint("lse", lse, lse_ext, named)
    if max_logits is not None:
        outs = (("out", out, out_ext), ("lse", lse, lse_ext))
        check_disjoint("max_logits", max_logits, max_ext, (*named, *outs))


def _launch_shapes(cfg, splits, block_size, lay, q, indices, block_table, req_id, topk_length,
                   attn_sink, out_s, lse_s, has_max, extra: ExtraPlan | None, topk_all: int,
                   aligned16: bool) -> tuple[tuple, tuple | None]:  # fmt: skip
    """The two launches' grids, integer arguments and keywords (see :func:`_launch`);
    ``aligned16``: every cache row starts 16-byte aligned (the sm90 kernel's L2 prefetch)."""
    c3 = lay.cache3
    num_tokens, h_q, _ = q.shape
    topk = indices.shape[1]
    fp8, fused, split = lay.fp8, block_table is not None, splits > 1
    has_len, has_sink = topk_length is not None, attn_sink is not None
    # The 1-D inputs' strides (any: a strided view reads as a contiguous copy would; 1 when
    # absent, the value a contiguous one specialises to).
    vec_s = tuple(1 if v is None else v.stride(0) for v in (topk_length, req_id, attn_sink))
    model1 = not hasattr(lay, "nope_dim")  # a Model1CacheLayout
    kv_s = kv_strides(lay, c3)  # fp8: bytes
    head_blocks = cfg.head_blocks(h_q)
    bt = block_table
    ints = (
        h_q, topk, min(lay.num_pages * lay.block_size, INT32_MAX), cfg.split_cols(topk_all),
        splits, head_blocks, *q.stride(), *kv_s, *indices.stride(),
        *(bt.stride() if fused else (0, 0)), *(bt.shape[::-1] if fused else (0, 0)),
        block_size if fused else 1, *vec_s, *out_s, *lse_s,
    )  # fmt: skip
    ints = (*ints, *(extra.ints if extra is not None else NO_EXTRA_INTS))  # the second set's
    sets = dict(MODEL1=model1, EXTRA=extra is not None, X_PAGE=extra.page if extra else 1,
                X_HAS_LEN=extra is not None and extra.has_len)  # fmt: skip
    if cfg.kernel == "sm90":
        pw, regs, rows, prefetch = _sm90_kernel().producer_shape(fp8, cfg.block_h)
        kwargs = dict(
            PAGE=lay.block_size, BLOCK_H=cfg.block_h, FP8=fp8, FUSED=fused, HAS_LEN=has_len,
            HAS_SINK=has_sink, SPLIT=split, HAS_MAX=has_max, NBUF=cfg.num_stages,
            PRODUCER_WARPS=pw, PRODUCER_REGS=regs, PRODUCER_ROWS=rows,
            num_warps=_sm90_kernel().default_warps(fp8, cfg.block_h),
            PREFETCH=prefetch if aligned16 else 0,  # (bulk copies need 16 B alignment)
            **sets,
        )  # fmt: skip
    else:
        kwargs = dict(
            PAGE=lay.block_size, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, FP8=fp8,
            FUSED=fused, HAS_LEN=has_len, HAS_SINK=has_sink,
            SPLIT=split, HAS_MAX=has_max, NUM_STAGES=cfg.num_stages, INTERPRET=INTERPRETER,
            num_warps=cfg.num_warps, E4M3_BITS=fp8 and e4m3_bits(q.device), **sets,
            # With splits the combine may start launching early (it waits for this kernel).
            **pdl_launch(q.device, (1 if split else 2) if cfg.pdl else 0),
        )  # fmt: skip
    main = ((num_tokens * splits * head_blocks,), ints, kwargs)
    if not split:
        return main, None
    block_h = min(cfg.combine_heads, next_pow2(h_q))
    head_blocks = -(-h_q // block_h)
    dim_blocks = NOPE // cfg.combine_dims
    ints = (h_q, splits, head_blocks, dim_blocks, vec_s[2], *out_s, *lse_s)
    kwargs = dict(
        BLOCK_H=block_h, BLOCK_D=cfg.combine_dims, SPLITS_P=next_pow2(splits),
        CHUNK=min(next_pow2(splits), max(1, COMBINE_TILE // (block_h * cfg.combine_dims))),
        HAS_SINK=has_sink, INTERPRET=INTERPRETER, num_warps=4,
        **pdl_launch(q.device, 2 if cfg.pdl else 0),
    )  # fmt: skip
    return main, ((num_tokens * head_blocks * dim_blocks,), ints, kwargs)


def _aligned16(c3: torch.Tensor) -> bool:
    """Every row of the 3-D cache view starts 16-byte aligned (bulk copies need it)."""
    s0, s1 = c3.stride(0) * c3.element_size(), c3.stride(1) * c3.element_size()
    return c3.data_ptr() % 16 == 0 and s0 % 16 == 0 and s1 % 16 == 0


def _sm90_fits(kv_cache: torch.Tensor, fp8: bool, model1: bool = False) -> bool:
    """The sm90 kernel's copies take this cache: fp8 rows are read as 32-bit words (as the
    Triton kernel reads them; MODEL1's page starts must then be 4-byte aligned); bf16 rows by
    16-byte cp.async, which needs contiguous rows whose row and page starts are 16-byte
    aligned."""
    c3 = kv_cache[:, :, 0, :] if kv_cache.dim() == 4 else kv_cache
    if fp8:
        return not model1 or (c3.stride(0) % 4 == 0 and c3.data_ptr() % 4 == 0)
    s0, s1, s2 = c3.stride()
    return s2 == 1 and s0 % 8 == 0 and s1 % 8 == 0 and c3.data_ptr() % 16 == 0


def _check_sm90(cfg: AttentionConfig, dev: torch.device, caches: tuple, fp8: bool,
                model1: bool) -> None:  # fmt: skip
    """The Gluon kernel runs here, takes these caches, and has a variant of ``cfg``'s shape
    for this format."""
    if not sm90_available(dev):
        raise ValueError(
            f"config.kernel='sm90' needs an sm_90 GPU and a Triton with Gluon; {dev} has "
            "neither or this is the interpreter: use kernel='triton'"
        )
    allowed = _sm90_kernel().SHAPES[fp8]
    if (cfg.block_h, cfg.num_stages) not in allowed:
        raise ValueError(
            f"config.kernel='sm90' takes (block_h, num_stages) in {allowed} on a "
            f"{'fp8' if fp8 else 'bf16'} cache, got {(cfg.block_h, cfg.num_stages)}"
        )
    for name, cache in zip(("kv_cache", "extra_kv_cache"), caches, strict=False):
        if not _sm90_fits(cache, fp8, model1):
            raise ValueError(
                f"config.kernel='sm90' reads {name} by {'4' if fp8 else '16'}-byte words: "
                + ("a MODEL1 fp8 cache's pages must start 4-byte aligned"
                   if fp8 else "its rows must be contiguous and start 16-byte aligned")
                + f" (strides {cache.stride()}); use kernel='triton'"
            )  # fmt: skip


def _check_workspace(ws: AttentionWorkspace, rows: int, h_q: int, dev: torch.device) -> None:
    for name, t in (("partial_out", ws.partial_out), ("partial_lse", ws.partial_lse)):
        check_tensor(f"workspace.{name}", t, dtype=torch.float32, device=dev)
        if not t.is_contiguous():
            raise ValueError(f"workspace.{name} must be contiguous")
    if ws.partial_out.shape[1:] != (h_q, NOPE) or ws.partial_lse.shape[1:] != (h_q,):
        raise ValueError(f"workspace was sized for {ws.partial_lse.shape[1]} heads, not {h_q}")
    if ws.rows < rows or ws.partial_out.shape[0] < rows:
        raise ValueError(
            f"workspace holds {ws.rows} partial rows but this call needs {rows} "
            "(size it with attention_workspace for at least this many tokens)"
        )


def _launch(q, c3, plan, indices, block_table, req_id, topk_length, attn_sink, out, lse,
            workspace, sm_scale, max_logits, extras):  # fmt: skip
    if plan.fmt == "fp8":
        kv_u8, kv_f32, kv_bf16 = c3, word_view(c3), c3.view(torch.bfloat16)
    else:
        kv_u8 = kv_f32 = kv_bf16 = c3
    fused = block_table is not None
    split = plan.combine is not None
    part_out = workspace.partial_out if split else out
    part_lse = workspace.partial_lse if split else lse
    sink = attn_sink if attn_sink is not None else lse
    grid, ints, kwargs = plan.main
    tensors = (
        q, kv_u8, kv_f32, kv_bf16, indices,
        topk_length if topk_length is not None else indices,
        block_table if fused else indices, req_id if fused else indices, sink,
        out, lse, part_out, part_lse, max_logits if max_logits is not None else lse,
    )  # fmt: skip
    tensors += extra_tensors(extras, plan.fmt == "fp8", indices)  # the second set's six
    if plan.config.kernel == "sm90":
        kernel = _sm90_kernel().sparse_mla_decode_sm90_kernel
    else:
        kernel = split_kv._sparse_mla_decode_kernel
    args = (*tensors, *ints, sm_scale * LOG2E)
    launch(kernel, grid, args, kwargs, plan)
    if split:
        grid, ints, kwargs = plan.combine
        args = (workspace.partial_out, workspace.partial_lse, sink, out, lse, *ints)
        launch(combine._combine_kernel, grid, args, kwargs, (plan, "combine"))
