"""The library's kernels as ``torch.library`` custom ops: ``torch.ops.sparse_mla.*``.

``torch.compile`` cannot see through a Triton launch made from Python that checks and
sizes its arguments, so every public kernel entry is also a custom op with its mutated
arguments declared and a fake (meta) implementation. Under ``torch.compile`` (while
``torch.compiler.is_compiling()``) the public functions route here; eagerly they run their
own code, which is what each op's implementation calls, so both give the same results and
the eager path pays nothing for the dispatcher (a few microseconds a call).

Representation (a custom op's schema takes tensors, scalars, lists, strings):

* **Every op is an out-variant returning nothing.** A custom op may not return a tensor
  that aliases an input, and engines pass ``out=`` buffers, so the outputs are always
  arguments the op mutates: the adapters below allocate them (traced ``torch.empty``) when
  the caller gives none, then return them as the public function does. The fakes thus
  compute nothing; they only have to exist (and return ``None``).
* **Configs are strings**: ``None`` (the heuristic / defaults) or ``repr`` of the tuple of
  the frozen dataclass's fields in order (:func:`_encode`); decoded once per distinct
  string (:func:`_decode`, cached). The tuple is built by attribute reads, which Dynamo
  folds into a constant. A remap ``layout`` is ``"auto"`` or such a string.
* **Workspaces are their tensors**: :class:`AttentionWorkspace` as two optional tensors,
  :class:`~sparse_mla.dcp.GlobalTopkWorkspace` as its tensor list plus its ``rows``, the
  top-k workspace is already one tensor. All are declared mutated.
* ``decode_lens`` of the expansion is an ``int[]`` (host-known, an int becomes ``[n] * B``)
  or a ``Tensor`` (device data); a CPU tensor of host lengths for a CUDA kernel would need a
  host read while tracing (a graph break): pass a list under ``torch.compile``.

Not ops: the DCP calls with a collective (``global_topk``, ``combine``) are Python over
their local ops (``local_topk_candidates``, ``merge_topk_candidates``, ``rescale_partial``)
and the collective, which Dynamo traces itself; ``DecodeMetadataBuilder.build`` and the
compat entries are Python over the ops here.

``torch.library.custom_op``, not ``triton_op`` + ``wrap_triton`` (which would let Inductor
see the kernels): under the interpreter a wrapped kernel is run on the fake tensors while
tracing (torch 2.13: "Cannot access data pointer of Tensor"), the wrappers' overlap checks
read ``data_ptr()`` too, and the user-kernel wrapper knows no ``launch_pdl`` launch option
(torch 2.13 source: only num_warps, num_stages, num_ctas and the like).
"""

from __future__ import annotations

import ast
import dataclasses
from functools import lru_cache

import torch

from .dcp import topk as _gtopk
from .dcp.combine import rescale_partial as _rescale_partial
from .ops.attention import attention as _attn
from .ops.attention.config import AttentionConfig
from .ops.decode_metadata import expand as _expand
from .ops.indexer import logits as _logits
from .ops.kv_cache import kv_cache as _kv
from .ops.remap import remap as _remap
from .ops.remap.layout import RemapLayout
from .ops.topk import api as _topk
from .ops.topk.config import TopKConfig

Tensor = torch.Tensor
_I32 = torch.int32

# ---- configs as strings ---------------------------------------------------------------------


_CONFIGS = {
    "topk": TopKConfig,
    "attention": AttentionConfig,
    "expand": _expand.ExpandConfig,
    "logits": _logits.IndexLogitsConfig,
    "remap": RemapLayout,
}
_FIELDS = {kind: tuple(f.name for f in dataclasses.fields(c)) for kind, c in _CONFIGS.items()}


def _encode(config: object, kind: str) -> str | None:
    """A config as the op's string: None stays None, a dataclass the repr of its fields."""
    if config is None or isinstance(config, str):
        return config
    return repr(tuple(getattr(config, name) for name in _FIELDS[kind]))


@lru_cache(maxsize=256)
def _decode(text: str | None, kind: str) -> object:
    """The config an :func:`_encode` string stands for (``"auto"`` and None as they are)."""
    if text is None or text == "auto":
        return text
    cls = _CONFIGS[kind]
    try:
        fields = ast.literal_eval(text)
        if isinstance(fields, tuple):
            return cls(*fields)  # the fields' values are checked by the public function
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    arg, auto = ("layout", "'auto', ") if kind == "remap" else ("config", "")
    raise ValueError(
        f"{arg} must be None, {auto}or the repr of a tuple of the {len(_FIELDS[kind])} "
        f"{cls.__name__} fields {_FIELDS[kind]} (as library._encode makes it), got {text!r}"
    )


def _eager(fn, *args, **kwargs):
    """Run a public function's own (eager) path from an op's implementation, even when the
    implementation runs during a compile session (where ``is_compiling()`` is True and the
    function would route back here)."""
    flag = getattr(torch.compiler, "_is_compiling_flag", False)
    if not flag:
        return fn(*args, **kwargs)
    torch.compiler._is_compiling_flag = False
    try:
        return fn(*args, **kwargs)
    finally:
        torch.compiler._is_compiling_flag = flag


def _op(name: str, mutates: tuple[str, ...]):
    """Register ``fn`` as ``sparse_mla::name`` with ``mutates`` and a fake that does nothing
    (every op writes only into its arguments)."""

    def register(fn):
        op = torch.library.custom_op(f"sparse_mla::{name}", mutates_args=mutates)(fn)
        op.register_fake(lambda *args, **kwargs: None)
        return op

    return register


# ---- decode metadata ------------------------------------------------------------------------


@_op("expand_decode_tokens", ("out_seq_lens", "out_block_table", "out_decode_lens", "out_req_id"))
def _expand_op(
    seq_lens: Tensor,
    block_table: Tensor,
    out_seq_lens: Tensor,
    out_block_table: Tensor,
    out_decode_lens: Tensor,
    out_req_id: Tensor,
    host_decode_lens: list[int] | None,
    decode_lens: Tensor | None,
    query_start_loc: Tensor | None,
    max_decode_len: int,
    num_tokens: int,
    uniform: bool | None,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    """sparse_mla.expand_decode_tokens into ``out_*`` (``num_tokens`` rows)."""
    out = _expand.ExpandedDecodeTokens(out_seq_lens, out_block_table, out_decode_lens, out_req_id)
    _eager(
        _expand.expand_decode_tokens,
        seq_lens,
        block_table,
        host_decode_lens if decode_lens is None else decode_lens,
        max_decode_len=max_decode_len,
        num_tokens=num_tokens,
        uniform=uniform,
        query_start_loc=query_start_loc,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=interleave,
        out=out,
        config=_decode(config, "expand"),
        enable_pdl=enable_pdl,
    )


def expand_decode_tokens(
    seq_lens,
    block_table,
    decode_lens=None,
    *,
    max_decode_len,
    num_tokens=None,
    uniform=None,
    query_start_loc=None,
    dcp_size=1,
    dcp_rank=0,
    interleave=1,
    out=None,
    config=None,
    enable_pdl=None,
):
    """:func:`sparse_mla.expand_decode_tokens` through ``torch.ops.sparse_mla``."""
    num_reqs, width = block_table.shape
    host, device_dl = None, None
    if isinstance(decode_lens, torch.Tensor):
        if decode_lens.device.type == "cpu" and seq_lens.device.type != "cpu":
            host = decode_lens.tolist()  # host lengths for a device kernel: a host read
        else:
            device_dl = decode_lens
    elif isinstance(decode_lens, int):
        host = [decode_lens] * num_reqs
    elif decode_lens is not None:
        host = list(decode_lens)
    if num_tokens is None:
        num_tokens = sum(host) if host is not None else num_reqs * max_decode_len
    if out is None:
        dev = seq_lens.device
        out = _expand.ExpandedDecodeTokens(
            torch.empty(num_tokens, dtype=_I32, device=dev),
            torch.empty((num_tokens, width), dtype=_I32, device=dev),
            torch.empty(num_tokens, dtype=_I32, device=dev),
            torch.empty(num_tokens, dtype=_I32, device=dev),
        )
    torch.ops.sparse_mla.expand_decode_tokens(
        seq_lens, block_table, *out, host, device_dl, query_start_loc, max_decode_len,
        num_tokens, uniform, dcp_size, dcp_rank, interleave, _encode(config, "expand"),
        enable_pdl,
    )  # fmt: skip
    return out


@_op("native_decode_seq_lens", ("out",))
def _native_op(
    seq_lens: Tensor,
    out: Tensor,
    next_n: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    """sparse_mla.ops.decode_metadata.native_decode_seq_lens into ``out``."""
    _eager(
        _expand.native_decode_seq_lens, seq_lens, next_n=next_n, dcp_size=dcp_size,
        dcp_rank=dcp_rank, interleave=interleave, out=out, config=_decode(config, "expand"),
        enable_pdl=enable_pdl,
    )  # fmt: skip


def native_decode_seq_lens(
    seq_lens, *, next_n, dcp_size=1, dcp_rank=0, interleave=1, out=None, config=None,
    enable_pdl=None,
):  # fmt: skip
    """:func:`native_decode_seq_lens` through ``torch.ops.sparse_mla``."""
    if out is None:
        out = torch.empty((seq_lens.shape[0], next_n), dtype=_I32, device=seq_lens.device)
    torch.ops.sparse_mla.native_decode_seq_lens(
        seq_lens, out, next_n, dcp_size, dcp_rank, interleave, _encode(config, "expand"),
        enable_pdl,
    )  # fmt: skip
    return out


@_op("dcp_local_seq_lens", ("out",))
def _dcp_local_op(
    seq_lens: Tensor,
    out: Tensor,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    """sparse_mla.dcp_local_seq_lens into ``out`` (never ``seq_lens`` itself)."""
    _eager(
        _expand.dcp_local_seq_lens, seq_lens, dcp_size=dcp_size, dcp_rank=dcp_rank,
        interleave=interleave, out=out, config=_decode(config, "expand"), enable_pdl=enable_pdl,
    )  # fmt: skip


def dcp_local_seq_lens(
    seq_lens, *, dcp_size, dcp_rank, interleave=1, out=None, config=None, enable_pdl=None
):
    """:func:`sparse_mla.dcp_local_seq_lens` through ``torch.ops.sparse_mla``."""
    if out is None:
        out = torch.empty(seq_lens.shape[0], dtype=_I32, device=seq_lens.device)
    elif out is seq_lens:  # in place: an op's mutated argument may not alias its input
        seq_lens = seq_lens.clone()
    torch.ops.sparse_mla.dcp_local_seq_lens(
        seq_lens, out, dcp_size, dcp_rank, interleave, _encode(config, "expand"), enable_pdl
    )
    return out


# ---- cache writes ---------------------------------------------------------------------------


@_op("write_indexer_k", ("k_cache",))
def _write_indexer_k_op(k: Tensor, k_cache: Tensor, slot_mapping: Tensor) -> None:
    """sparse_mla.write_indexer_k: writes ``k_cache`` in place."""
    _eager(_kv.write_indexer_k, k, k_cache, slot_mapping)


def write_indexer_k(k, k_cache, slot_mapping):
    """:func:`sparse_mla.write_indexer_k` through ``torch.ops.sparse_mla``."""
    torch.ops.sparse_mla.write_indexer_k(k, k_cache, slot_mapping)
    return k_cache


@_op("write_mla_latent", ("kv_cache",))
def _write_mla_latent_op(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor
) -> None:
    """sparse_mla.write_mla_latent: writes ``kv_cache`` in place."""
    _eager(_kv.write_mla_latent, kv_c, k_pe, kv_cache, slot_mapping)


def write_mla_latent(kv_c, k_pe, kv_cache, slot_mapping):
    """:func:`sparse_mla.write_mla_latent` through ``torch.ops.sparse_mla``."""
    torch.ops.sparse_mla.write_mla_latent(kv_c, k_pe, kv_cache, slot_mapping)
    return kv_cache


# ---- indexer logits -------------------------------------------------------------------------


@_op("index_logits", ("out",))
def _index_logits_op(
    q: Tensor,
    weights: Tensor,
    k_cache: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    out: Tensor,
    next_n: int | None,
    max_len: int | None,
    config: str | None,
) -> None:
    """sparse_mla.index_logits into ``out``."""
    _eager(
        _logits.index_logits, q, weights, k_cache, seq_lens, block_table, next_n=next_n,
        max_len=max_len, out=out, config=_decode(config, "logits"),
    )  # fmt: skip


def index_logits(
    q, weights, k_cache, seq_lens, block_table, *, next_n=None, max_len=None, out=None,
    config=None,
):  # fmt: skip
    """:func:`sparse_mla.index_logits` through ``torch.ops.sparse_mla``."""
    if out is None:
        if max_len is None:  # the block table's capacity (page size: dim 1 of either format)
            max_len = block_table.shape[1] * k_cache.shape[1]
        out = torch.empty((q.shape[0], max_len), dtype=torch.float32, device=q.device)
    torch.ops.sparse_mla.index_logits(
        q, weights, k_cache, seq_lens, block_table, out, next_n, max_len, _encode(config, "logits")
    )
    return out


# ---- top-k ----------------------------------------------------------------------------------


@_op("select_topk", ("out", "valid_counts_out", "workspace"))
def _select_topk_op(
    logits: Tensor,
    seq_lens: Tensor,
    out: Tensor,
    valid_counts_out: Tensor | None,
    block_table: Tensor | None,
    req_id: Tensor | None,
    workspace: Tensor | None,
    k: int,
    block_size: int,
    block_stride_rows: int | None,
    num_splits: int | None,
    prefilter: bool | None,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    """sparse_mla.select_topk into ``out`` (and ``valid_counts_out``); ``workspace`` is
    scratch."""
    _eager(
        _topk.select_topk, logits, seq_lens, k=k, out=out, block_table=block_table,
        req_id=req_id, block_size=block_size, block_stride_rows=block_stride_rows,
        valid_counts_out=valid_counts_out, workspace=workspace, num_splits=num_splits,
        prefilter=prefilter, config=_decode(config, "topk"), enable_pdl=enable_pdl,
    )  # fmt: skip


def select_topk(
    logits, seq_lens, *, k=2048, out=None, block_table=None, req_id=None, block_size=64,
    block_stride_rows=None, valid_counts_out=None, return_valid_counts=False, workspace=None,
    num_splits=None, prefilter=None, config=None, enable_pdl=None,
):  # fmt: skip
    """:func:`sparse_mla.select_topk` through ``torch.ops.sparse_mla``."""
    rows = logits.shape[0]
    if out is None:
        out = torch.empty((rows, k), dtype=_I32, device=logits.device)
    counts = valid_counts_out
    if counts is None and return_valid_counts:
        counts = torch.empty(rows, dtype=_I32, device=logits.device)
    torch.ops.sparse_mla.select_topk(
        logits, seq_lens, out, counts, block_table, req_id, workspace, k, block_size,
        block_stride_rows, num_splits, prefilter, _encode(config, "topk"), enable_pdl,
    )  # fmt: skip
    return (out, counts) if return_valid_counts else out


# ---- remap ----------------------------------------------------------------------------------


@_op("convert_req_index_to_global_index", ("out", "valid_counts_out"))
def _convert_op(
    req_id: Tensor,
    block_table: Tensor,
    token_indices: Tensor,
    out: Tensor,
    valid_counts_out: Tensor | None,
    return_valid_counts: bool,
    prefill_request_ids: Tensor | None,
    prefill_workspace_starts: Tensor | None,
    block_size: int,
    block_stride_rows: int | None,
    layout: str,
    enable_pdl: bool | None,
) -> None:
    """sparse_mla.convert_req_index_to_global_index into ``out`` (and the counts)."""
    _eager(
        _remap.convert_req_index_to_global_index, req_id, block_table, token_indices,
        block_size=block_size, block_stride_rows=block_stride_rows,
        prefill_request_ids=prefill_request_ids,
        prefill_workspace_starts=prefill_workspace_starts,
        return_valid_counts=return_valid_counts, out=out,
        valid_counts_out=valid_counts_out, layout=_decode(layout, "remap"), enable_pdl=enable_pdl,
    )  # fmt: skip


def _remap_outputs(token_indices, out, valid_counts_out, return_valid_counts):
    if out is None:
        out = torch.empty(token_indices.shape, dtype=_I32, device=token_indices.device)
    counts = valid_counts_out
    if counts is None and return_valid_counts:
        counts = torch.empty(token_indices.shape[0], dtype=_I32, device=token_indices.device)
    return out, counts


def convert_req_index_to_global_index(
    req_id, block_table, token_indices, *, block_size=64, block_stride_rows=None,
    prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
    out=None, valid_counts_out=None, layout="auto", enable_pdl=None,
):  # fmt: skip
    """:func:`sparse_mla.convert_req_index_to_global_index` through ``torch.ops.sparse_mla``."""
    out, counts = _remap_outputs(token_indices, out, valid_counts_out, return_valid_counts)
    torch.ops.sparse_mla.convert_req_index_to_global_index(
        req_id, block_table, token_indices, out, counts, return_valid_counts,
        prefill_request_ids, prefill_workspace_starts, block_size, block_stride_rows,
        _encode(layout, "remap"), enable_pdl,
    )  # fmt: skip
    return (out, counts) if return_valid_counts else out


@_op("filter_and_convert_dcp_index", ("out", "valid_counts_out"))
def _filter_op(
    req_id: Tensor,
    block_table: Tensor,
    token_indices: Tensor,
    out: Tensor,
    valid_counts_out: Tensor | None,
    return_valid_counts: bool,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    block_size: int,
    block_stride_rows: int | None,
    compact: bool,
    layout: str,
    enable_pdl: bool | None,
) -> None:
    """sparse_mla.filter_and_convert_dcp_index into ``out`` (and the counts)."""
    _eager(
        _remap.filter_and_convert_dcp_index, req_id, block_table, token_indices,
        dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave, block_size=block_size,
        block_stride_rows=block_stride_rows, compact=compact,
        return_valid_counts=return_valid_counts, out=out,
        valid_counts_out=valid_counts_out, layout=_decode(layout, "remap"), enable_pdl=enable_pdl,
    )  # fmt: skip


def filter_and_convert_dcp_index(
    req_id, block_table, token_indices, *, dcp_size, dcp_rank, interleave=1, block_size=64,
    block_stride_rows=None, compact=True, return_valid_counts=False, out=None,
    valid_counts_out=None, layout="auto", enable_pdl=None,
):  # fmt: skip
    """:func:`sparse_mla.filter_and_convert_dcp_index` through ``torch.ops.sparse_mla``."""
    out, counts = _remap_outputs(token_indices, out, valid_counts_out, return_valid_counts)
    torch.ops.sparse_mla.filter_and_convert_dcp_index(
        req_id, block_table, token_indices, out, counts, return_valid_counts,
        dcp_size, dcp_rank, interleave, block_size, block_stride_rows, compact,
        _encode(layout, "remap"), enable_pdl,
    )  # fmt: skip
    return (out, counts) if return_valid_counts else out


# ---- attention ------------------------------------------------------------------------------


@_op("sparse_mla_decode", ("out", "lse", "partial_out", "partial_lse", "max_logits"))
def _decode_op(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    out: Tensor,
    lse: Tensor,
    block_table: Tensor | None,
    req_id: Tensor | None,
    topk_length: Tensor | None,
    attn_sink: Tensor | None,
    partial_out: Tensor | None,
    partial_lse: Tensor | None,
    sm_scale: float,
    block_size: int | None,
    config: str | None,
    max_logits: Tensor | None = None,
) -> None:
    """sparse_mla.sparse_mla_decode into ``out``/``lse`` (and ``max_logits``); ``partial_*``
    (the AttentionWorkspace's two tensors, or None) are scratch."""
    ws = None if partial_out is None else _attn.AttentionWorkspace(partial_out, partial_lse)
    _eager(
        _attn.sparse_mla_decode, q, kv_cache, indices, sm_scale=sm_scale,
        block_table=block_table, req_id=req_id, block_size=block_size, topk_length=topk_length,
        attn_sink=attn_sink, out=out, lse=lse, workspace=ws,
        config=_decode(config, "attention"), max_logits=max_logits,
    )  # fmt: skip


def sparse_mla_decode(
    q, kv_cache, indices, *, sm_scale, block_table=None, req_id=None, block_size=None,
    topk_length=None, attn_sink=None, out=None, lse=None, workspace=None, config=None,
    max_logits=None,
):  # fmt: skip
    """:func:`sparse_mla.sparse_mla_decode` through ``torch.ops.sparse_mla``."""
    t, h = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((t, h, _attn.NOPE), dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    ws = (None, None) if workspace is None else (workspace.partial_out, workspace.partial_lse)
    torch.ops.sparse_mla.sparse_mla_decode(
        q, kv_cache, indices, out, lse, block_table, req_id, topk_length, attn_sink, *ws,
        float(sm_scale), block_size, _encode(config, "attention"), max_logits,
    )  # fmt: skip
    return out, lse


# ---- DCP: the local steps -------------------------------------------------------------------

_GTOPK_TENSORS = tuple(
    f.name
    for f in dataclasses.fields(_gtopk.GlobalTopkWorkspace)
    if f.name not in ("rows", "k", "dcp_size")
)


def _gtopk_workspace(tensors: list[Tensor], rows: int, k: int, dcp_size: int):
    return _gtopk.GlobalTopkWorkspace(rows, k, dcp_size, *tensors)


def _gtopk_tensors(ws) -> list[Tensor]:
    return [getattr(ws, name) for name in _GTOPK_TENSORS]


@_op("local_topk_candidates", ("workspace", "positions_out"))
def _local_candidates_op(
    local_logits: Tensor,
    local_seq_lens: Tensor,
    workspace: list[Tensor],
    positions_out: Tensor | None,
    workspace_rows: int,
    k: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> None:
    """sparse_mla.dcp.local_topk_candidates into the workspace's ``send`` (or into
    ``positions_out``); ``workspace``: a GlobalTopkWorkspace's tensors."""
    _eager(
        _gtopk.local_topk_candidates, local_logits, local_seq_lens, k=k, dcp_size=dcp_size,
        dcp_rank=dcp_rank, interleave=interleave,
        workspace=_gtopk_workspace(workspace, workspace_rows, k, dcp_size),
        positions_out=positions_out,
    )  # fmt: skip


def local_topk_candidates(
    local_logits, local_seq_lens, *, k, dcp_size, dcp_rank, interleave, workspace=None,
    positions_out=None,
):  # fmt: skip
    """:func:`sparse_mla.dcp.local_topk_candidates` through ``torch.ops.sparse_mla``."""
    rows = local_logits.shape[0]
    if workspace is None:
        workspace = _gtopk.global_topk_workspace(
            rows, k=k, dcp_size=dcp_size, device=local_logits.device
        )
    torch.ops.sparse_mla.local_topk_candidates(
        local_logits, local_seq_lens, _gtopk_tensors(workspace), positions_out, workspace.rows,
        k, dcp_size, dcp_rank, interleave,
    )  # fmt: skip
    if positions_out is not None:
        return positions_out
    return workspace.send[: rows * 2 * k].view(rows, 2, k)


@_op("merge_topk_candidates", ("out", "workspace"))
def _merge_candidates_op(
    candidates: Tensor, out: Tensor, workspace: list[Tensor], workspace_rows: int, k: int
) -> None:
    """sparse_mla.dcp.merge_topk_candidates into ``out``; ``workspace``: a
    GlobalTopkWorkspace's tensors (scratch)."""
    ws = _gtopk_workspace(workspace, workspace_rows, k, candidates.shape[0])
    _eager(_gtopk.merge_topk_candidates, candidates, k=k, out=out, workspace=ws)


def merge_topk_candidates(candidates, *, k, out=None, workspace=None):
    """:func:`sparse_mla.dcp.merge_topk_candidates` through ``torch.ops.sparse_mla``."""
    w, rows = candidates.shape[0], candidates.shape[1]
    if workspace is None:
        workspace = _gtopk.global_topk_workspace(rows, k=k, dcp_size=w, device=candidates.device)
    if out is None:
        out = torch.empty((rows, k), dtype=_I32, device=candidates.device)
    torch.ops.sparse_mla.merge_topk_candidates(
        candidates, out, _gtopk_tensors(workspace), workspace.rows, k
    )
    return out


@_op("rescale_partial", ("dest", "lse_out"))
def _rescale_op(
    out: Tensor, lse_all: Tensor, dest: Tensor, lse_out: Tensor, dcp_rank: int, reduce: str
) -> None:
    """sparse_mla.dcp.rescale_partial into ``dest`` and ``lse_out``."""
    _eager(
        _rescale_partial, out, lse_all, dcp_rank=dcp_rank, reduce=reduce, dest=dest,
        lse_out=lse_out,
    )  # fmt: skip


def rescale_partial(out, lse_all, *, dcp_rank, reduce="all_reduce", dest, lse_out):
    """:func:`sparse_mla.dcp.rescale_partial` through ``torch.ops.sparse_mla``."""
    torch.ops.sparse_mla.rescale_partial(out, lse_all, dest, lse_out, dcp_rank, reduce)
    return dest, lse_out


OPS = (
    "expand_decode_tokens",
    "native_decode_seq_lens",
    "dcp_local_seq_lens",
    "write_indexer_k",
    "write_mla_latent",
    "index_logits",
    "select_topk",
    "convert_req_index_to_global_index",
    "filter_and_convert_dcp_index",
    "sparse_mla_decode",
    "local_topk_candidates",
    "merge_topk_candidates",
    "rescale_partial",
)
"""Names of the custom ops, ``torch.ops.sparse_mla.<name>``."""


# ---- the metadata builder's launches under torch.compile ------------------------------------


def launch_native(seq_lens, out, decode_lens_out, *, next_n, dcp_interleave, **kw) -> None:
    """``DecodeMetadataBuilder``'s native launch through the ops: the lengths, then
    ``decode_lens_out`` (the kernel's second output) filled with ``next_n``."""
    native_decode_seq_lens(seq_lens, next_n=next_n, interleave=dcp_interleave, out=out, **kw)
    if decode_lens_out is not None:
        decode_lens_out.fill_(next_n)


def launch_expand(
    seq_lens, block_table, out, *, uniform_n=None, device_decode_lens=None, dcp_interleave, **kw
) -> None:
    """``DecodeMetadataBuilder``'s flattened launch through the ops (same kernel: uniform
    ``n``, ``query_start_loc`` or device decode lengths)."""
    lens = uniform_n if device_decode_lens is None else device_decode_lens
    expand_decode_tokens(
        seq_lens, block_table, lens, num_tokens=out.seq_lens.shape[0],
        uniform=True if uniform_n is not None else None, interleave=dcp_interleave, out=out, **kw,
    )  # fmt: skip
