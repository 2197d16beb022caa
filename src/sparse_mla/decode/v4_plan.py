"""One DeepSeek-V4 attention layer's decode step, sized once, run eagerly or as one CUDA graph.

The V4 counterpart of :class:`~sparse_mla.decode.DecodePlan`, from the projected rows
(``decode/v4_naive.py`` says which, the layouts of the window and compressed caches, and is
the reference). Stages, each a library op on plan buffers:

1. metadata (``v4_row_metadata``): per row its request and position (device-side from
   ``query_start_loc`` and ``seq_lens``: no host data, so ragged batches and MTP rows run
   eagerly and captured alike), the window positions ``p - window + 1 .. p``, the visible
   compressed count ``(p + 1) // rate`` and the window slot;
2. cache writes: the window row (``write_mla_latent``), the compressors
   (``compressor_decode``: CSA's and its indexer's, or HCA's);
3. CSA: indexer logits over the visible compressed entries (``index_logits``, one table row
   per step row), exact top-k positions (``select_topk``); HCA: every visible entry (a
   constant ``0 .. max_compressed - 1`` index set cut by ``extra_topk_length``);
4. attention over the window plus the compressed set in one softmax, with the sink
   (``sparse_mla_decode``: positions remapped through the block tables as they load);
5. the inverse RoPE on the output's trailing 64 dims (angle ``-p``; ``inverse_rope_``).

:data:`V4_STAGES` names them as :meth:`V4DecodePlan.stage_calls` returns them one by one
(metadata, window write, compressors, indexer logits, top-k, attention, inverse rope).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._checks import check_int
from .._runtime import canonical_device
from ..ops.attention import attention_workspace, sparse_mla_decode
from ..ops.compressor import compressor_decode
from ..ops.indexer import index_logits
from ..ops.kv_cache import write_mla_latent
from ..ops.topk import MAX_K, select_topk, supported_k, topk_workspace
from .v4_naive import LAYER_KINDS, V4_DIM, V4_NOPE, V4_ROPE, V4Compressor, V4StepInputs
from .v4_rows import inverse_rope_, v4_row_metadata

#: A V4 layer's decode stages (a sliding layer has no compressors, indexer logits nor top-k;
#: an HCA layer no indexer logits nor top-k): :meth:`V4DecodePlan.stage_calls`.
V4_STAGES = ("metadata", "window write", "compressors", "indexer logits", "top-k", "attention",
             "inverse rope")  # fmt: skip


def v4_stages(kind: str) -> tuple[str, ...]:
    """The stages of a ``kind`` layer ("sliding", "csa" or "hca"), in :data:`V4_STAGES` order."""
    skip = {"sliding": ("compressors", "indexer logits", "top-k"),
            "hca": ("indexer logits", "top-k"), "csa": ()}[kind]  # fmt: skip
    return tuple(name for name in V4_STAGES if name not in skip)


@dataclass(frozen=True)
class V4DecodePlanConfig:
    """What a :class:`V4DecodePlan` is sized for (host ints / flags), one per layer kind.

    kind: "sliding", "csa" or "hca". max_num_tokens: rows per step, padding included.
    max_num_requests: requests per step. num_heads: ``h`` of q (64 in V4-Flash; a TP shard
    fewer). max_decode_len: largest ``n_b`` (1 + MTP drafts). window: sliding window (128).
    compress_rate: 4 (CSA) or 128 (HCA). max_compressed: compressed entries a request may
    have (``max_seq_len // compress_rate``): the indexer's logit columns (CSA) or the HCA set's
    width. topk: the indexer's k (512). index_heads / index_dim: the indexer's q shape.
    cache_format: "model1_fp8" or "model1_bf16" (the window and compressed caches).
    """

    kind: str
    max_num_tokens: int
    max_num_requests: int
    num_heads: int
    max_decode_len: int = 1
    window: int = 128
    compress_rate: int = 4
    max_compressed: int = 2048
    topk: int = 512
    index_heads: int = 64
    index_dim: int = 128
    cache_format: str = "model1_fp8"
    eps: float = 1e-6


class V4StepOutput(NamedTuple):
    """Views into the plan's buffers (the next run overwrites them).

    out: bf16 ``[T, h, 512]`` (inverse RoPE applied; the input of ``o_a_proj``). lse: fp32
    ``[T, h]`` (natural log, before the sink; ``-inf`` on padding rows). compressed: int32
    ``[T, k]`` request-local compressed positions attended (CSA: top-k, -1 padded; HCA: the
    constant ``0 .. max_compressed - 1``, of which ``compressed_len`` count), or None.
    compressed_len: int32 ``[T]`` valid leading entries of ``compressed`` (HCA), else None.
    """

    out: torch.Tensor
    lse: torch.Tensor
    compressed: torch.Tensor | None
    compressed_len: torch.Tensor | None


class V4DecodePlan:
    """A V4 layer's decode step with every buffer allocated once (one plan per layer kind
    serves every layer of that kind). :meth:`run` runs it eagerly (ragged ``n_b``, padding
    rows); :meth:`capture` records it as ONE CUDA graph on fixed input tensors, :meth:`replay`
    reruns it on whatever they hold."""

    def __init__(
        self, config: V4DecodePlanConfig, *, sm_scale: float,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        c = config
        if c.kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {LAYER_KINDS}, got {c.kind!r}")
        for name in ("max_num_tokens", "max_num_requests", "num_heads", "max_decode_len",
                     "window", "compress_rate", "max_compressed"):  # fmt: skip
            check_int(name, getattr(c, name), lo=1)
        if c.kind == "csa" and not supported_k(c.topk):
            raise ValueError(f"topk must be an int in [1, {MAX_K}], got {c.topk!r}")
        if c.cache_format not in ("model1_fp8", "model1_bf16"):
            raise ValueError(f"cache_format must be 'model1_fp8' or 'model1_bf16', got "
                             f"{c.cache_format!r}")  # fmt: skip
        self.config, self.sm_scale = c, float(sm_scale)
        self.device = dev = canonical_device(device)
        t, i32 = c.max_num_tokens, torch.int32
        self._req = torch.empty(t, dtype=i32, device=dev)
        self._pos = torch.empty(t, dtype=i32, device=dev)
        self._slot = torch.empty(t, dtype=torch.int64, device=dev)
        self._visible = torch.empty(t, dtype=i32, device=dev)
        self._win_pos = torch.empty(t, c.window, dtype=i32, device=dev)
        self._compressed = self._logits = self._topk_ws = None
        extra_cols = 0
        if c.kind == "csa":
            self._logits = torch.empty(t, c.max_compressed, dtype=torch.float32, device=dev)
            self._compressed = torch.empty(t, c.topk, dtype=i32, device=dev)
            self._topk_ws = topk_workspace(t, device=dev)
            extra_cols = c.topk
        elif c.kind == "hca":  # every visible entry: a constant set, cut per row by its count
            cols = torch.arange(c.max_compressed, dtype=i32, device=dev)
            self._compressed = cols.expand(t, -1).contiguous()
            extra_cols = c.max_compressed
        self._out = torch.empty(t, c.num_heads, V4_DIM, dtype=torch.bfloat16, device=dev)
        self._lse = torch.empty(t, c.num_heads, dtype=torch.float32, device=dev)
        fmt = "fp8" if c.cache_format == "model1_fp8" else "bf16"
        self._attn_ws = attention_workspace(t, c.num_heads, c.window + extra_cols,
                                            cache_format=fmt, device=dev)  # fmt: skip
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_out: V4StepOutput | None = None

    # ---- the stages ---------------------------------------------------------------------

    def _metadata(self, x: V4StepInputs, rows: int) -> None:
        """Request, position, visible count, window positions and window slot of each row
        (padding rows: request B, position -1; one kernel, ``v4_rows.py``)."""
        c = self.config
        v4_row_metadata(
            x.query_start_loc, x.seq_lens, x.window_block_table, page=x.window_cache.shape[1],
            window=c.window, compress_rate=c.compress_rate, req=self._req[:rows],
            pos=self._pos[:rows], visible=self._visible[:rows], win_pos=self._win_pos[:rows],
            slot=self._slot[:rows],
        )  # fmt: skip

    def _write_window(self, x: V4StepInputs, rows: int) -> None:
        write_mla_latent(x.kv[:, :V4_NOPE], x.kv[:, V4_NOPE:], x.window_cache, self._slot[:rows])

    def _compress(self, x: V4StepInputs, cmp: V4Compressor | None,
                  idx: V4Compressor | None) -> None:  # fmt: skip
        c = self.config
        common = {"max_decode_len": c.max_decode_len, "eps": c.eps,
                  "query_start_loc": x.query_start_loc}  # fmt: skip
        if c.kind != "sliding":
            compressor_decode(
                x.cmp_kv, x.cmp_gate, cmp.state_kv, cmp.state_gate, cmp.cache, x.seq_lens,
                x.compressed_block_table, cmp.position_bias, cmp.norm_weight, cmp.cos_sin,
                compress_rate=c.compress_rate, overlap=c.kind == "csa", **common,
            )  # fmt: skip
        if c.kind == "csa":
            compressor_decode(
                x.idx_kv, x.idx_gate, idx.state_kv, idx.state_gate, idx.cache, x.seq_lens,
                x.compressed_block_table, idx.position_bias, idx.norm_weight, idx.cos_sin,
                compress_rate=c.compress_rate, overlap=True, **common,
            )  # fmt: skip

    def _index_logits(self, x: V4StepInputs, rows: int, idx: V4Compressor) -> None:
        """CSA: the indexer logits over each row's visible compressed entries."""
        b = x.seq_lens.shape[0]
        table = x.compressed_block_table[self._req[:rows].clamp(max=b - 1).long()]
        index_logits(x.q_idx, x.idx_weights, idx.cache, self._visible[:rows], table,
                     max_len=self.config.max_compressed, out=self._logits[:rows])  # fmt: skip

    def _topk(self, rows: int) -> None:
        """CSA: the top-k positions of those logits."""
        select_topk(self._logits[:rows], self._visible[:rows], k=self.config.topk,
                    out=self._compressed[:rows], workspace=self._topk_ws)  # fmt: skip

    def _attend(self, x: V4StepInputs, rows: int, cmp: V4Compressor | None) -> None:
        c = self.config
        extra = {}
        if c.kind != "sliding":
            extra = {
                "extra_kv_cache": cmp.cache, "extra_indices": self._compressed[:rows],
                "extra_block_table": x.compressed_block_table,
                "extra_block_size": cmp.cache.shape[1],
            }  # fmt: skip
            if c.kind == "hca":
                extra["extra_topk_length"] = self._visible[:rows]
        sparse_mla_decode(
            x.q, x.window_cache, self._win_pos[:rows], sm_scale=self.sm_scale,
            block_table=x.window_block_table, req_id=self._req[:rows],
            block_size=x.window_cache.shape[1], attn_sink=x.attn_sink,
            out=self._out[:rows], lse=self._lse[:rows], workspace=self._attn_ws, **extra,
        )  # fmt: skip

    def _inverse_rope(self, x: V4StepInputs, rows: int) -> None:
        """Rotate the output's trailing 64 dims by ``-p`` (one kernel, ``v4_rows.py``)."""
        inverse_rope_(self._out[:rows], x.out_cos_sin, self._pos[:rows], rope_dim=V4_ROPE)

    # ---- eager / graph ------------------------------------------------------------------------

    def run(
        self, inputs: V4StepInputs, *, compressor: V4Compressor | None = None,
        indexer: V4Compressor | None = None,
    ) -> V4StepOutput:  # fmt: skip
        """Run one step eagerly on ``inputs`` (``T = q.shape[0]`` rows; rows past
        ``query_start_loc[B] - query_start_loc[0]`` are padding: out 0, lse ``-inf``).
        ``compressor``: the layer's attention compressor (CSA / HCA); ``indexer``: CSA's."""
        rows = self._check(inputs, compressor, indexer)
        c = self.config
        self._metadata(inputs, rows)
        self._write_window(inputs, rows)
        self._compress(inputs, compressor, indexer)
        if c.kind == "csa":
            self._index_logits(inputs, rows, indexer)
            self._topk(rows)
        self._attend(inputs, rows, compressor)
        self._inverse_rope(inputs, rows)
        comp = None if self._compressed is None else self._compressed[:rows]
        comp_len = self._visible[:rows] if c.kind == "hca" else None
        return V4StepOutput(self._out[:rows], self._lse[:rows], comp, comp_len)

    @property
    def stages(self) -> tuple[str, ...]:
        """This layer kind's stages (:func:`v4_stages`)."""
        return v4_stages(self.config.kind)

    def stage_calls(
        self, inputs: V4StepInputs, *, compressor: V4Compressor | None = None,
        indexer: V4Compressor | None = None,
    ) -> dict[str, Callable[[], None]]:  # fmt: skip
        """Each of :attr:`stages` as a no-argument call on this plan's buffers, for timing them
        one by one (e.g. one CUDA graph each). Runs the metadata stage once eagerly; a stage
        reads what the ones before it last wrote (run the step once first for real data)."""
        rows = self._check(inputs, compressor, indexer)
        x, cmp, idx = inputs, compressor, indexer
        self._metadata(x, rows)
        calls = {
            "metadata": lambda: self._metadata(x, rows),
            "window write": lambda: self._write_window(x, rows),
            "compressors": lambda: self._compress(x, cmp, idx),
            "indexer logits": lambda: self._index_logits(x, rows, idx),
            "top-k": lambda: self._topk(rows),
            "attention": lambda: self._attend(x, rows, cmp),
            "inverse rope": lambda: self._inverse_rope(x, rows),
        }
        return {name: calls[name] for name in self.stages}

    def _check(self, x: V4StepInputs, cmp, idx) -> int:
        c, rows = self.config, x.q.shape[0]
        check_int("num_tokens", rows, lo=1, hi=c.max_num_tokens)
        if x.q.dim() != 3 or x.q.shape[1:] != (c.num_heads, V4_DIM):
            raise ValueError(f"q must be [T, {c.num_heads}, {V4_DIM}], got {tuple(x.q.shape)}")
        if x.kv.shape != (rows, V4_DIM):
            raise ValueError(f"kv must be [{rows}, {V4_DIM}], got {tuple(x.kv.shape)}")
        b = x.seq_lens.shape[0]
        check_int("requests", b, lo=1, hi=c.max_num_requests)
        if x.query_start_loc.shape != (b + 1,):
            raise ValueError(f"query_start_loc must be [{b + 1}], got "
                             f"{tuple(x.query_start_loc.shape)}")  # fmt: skip
        need = {"sliding": (), "hca": ("compressor",), "csa": ("compressor", "indexer")}[c.kind]
        for name, v in (("compressor", cmp), ("indexer", idx)):
            if (v is not None) != (name in need):
                raise ValueError(f"a {c.kind} layer takes {need or 'no compressor'}; {name} is "
                                 f"{'missing' if v is None else 'not used'}")  # fmt: skip
        if c.kind != "sliding" and (x.cmp_kv is None or x.compressed_block_table is None):
            raise ValueError(f"a {c.kind} layer needs cmp_kv, cmp_gate, compressed_block_table")
        if c.kind == "csa" and (x.q_idx is None or x.idx_weights is None or x.idx_kv is None):
            raise ValueError("a csa layer needs idx_kv, idx_gate, q_idx and idx_weights")
        if c.kind == "csa" and x.q_idx.shape != (rows, c.index_heads, c.index_dim):
            raise ValueError(f"q_idx must be [{rows}, {c.index_heads}, {c.index_dim}], got "
                             f"{tuple(x.q_idx.shape)}")  # fmt: skip
        if c.kind != "sliding":
            cols = x.compressed_block_table.shape[1] * cmp.cache.shape[1]
            if cols > c.max_compressed:
                raise ValueError(f"compressed_block_table addresses {cols} entries, more than "
                                 f"max_compressed={c.max_compressed}")  # fmt: skip
        return rows

    def capture(
        self, inputs: V4StepInputs, *, compressor: V4Compressor | None = None,
        indexer: V4Compressor | None = None, warmup: int = 2,
    ) -> V4StepOutput:  # fmt: skip
        """Capture the whole step as one CUDA graph (CUDA only). The tensors of ``inputs`` and
        the compressors become the graph's: refill them in place before each :meth:`replay`.
        Runs the step ``warmup`` times eagerly first (the caches and rings receive those
        writes: capture on a scratch copy or before the real step)."""
        if self.device.type != "cuda":
            raise RuntimeError("capture() needs a CUDA device; use run() elsewhere")
        kw = {"compressor": compressor, "indexer": indexer}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.run(inputs, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            result = self.run(inputs, **kw)
        self._graph, self._graph_out = graph, result
        return result

    def replay(self) -> V4StepOutput:
        """Replay the captured step (no allocation, no host sync)."""
        if self._graph is None or self._graph_out is None:
            raise RuntimeError("replay() before capture()")
        self._graph.replay()
        return self._graph_out
