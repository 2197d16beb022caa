"""One DSA attention layer's decode step, sized once, run eagerly or as one CUDA graph.

Stages (each a library op): metadata (MTP expansion when the indexer cannot take the rows
natively), cache writes (indexer key + MLA latent), indexer logits, exact top-k, sparse MLA
attention. Positions become cache slots in the top-k epilogue (default), in the attention's
loads, or in a separate remap launch (``DecodePlanConfig.remap``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._checks import check_int
from .._runtime import canonical_device
from ..ops.attention import attention_workspace, sparse_mla_decode
from ..ops.decode_metadata import DecodeMetadata, DecodeMetadataBuilder
from ..ops.indexer import index_logits
from ..ops.kv_cache import write_indexer_k, write_mla_latent
from ..ops.remap import convert_req_index_to_global_index
from ..ops.topk import MAX_K, select_topk, supported_k, topk_workspace
from .naive import NOPE_DIM, sparse_attention_torch

MAX_NATIVE_N = 8  # query tokens per request the indexer kernel takes natively
LATENT_DIM = 576
STAGES = ("metadata", "cache writes", "logits", "top-k", "attention")


@dataclass(frozen=True)
class DecodePlanConfig:
    """What a :class:`DecodePlan` is sized for (all host ints / flags).

    max_num_tokens: query rows per step, CUDA-graph padding included.
    max_num_requests: requests per step; max_blocks_per_req: block-table columns.
    max_decode_len: largest ``n_b`` (1 + draft tokens; a prefill chunk's length).
    num_heads: ``h_q`` of the absorbed MLA query. topk: the indexer's k (1 to ``MAX_K``).
    block_size: tokens per page of both caches (checked against them each run).
    index_heads, index_dim: indexer q shape.
    mla_fp8: the MLA latent cache is FlashMLA's fp8 format (else bf16); sizes the attention
    workspace and is checked against the cache each run.
    remap: where request-local positions become cache slots: "topk" (top-k writes slots
    directly), "attention" (top-k writes positions, the attention remaps them as it loads:
    needs the library attention), "separate" (positions, then the remap op: slots). The last
    two also return the positions (``DecodeStepOutput.positions``).
    attention: "auto" (the library's sparse_mla_decode) or "torch" (batched PyTorch).
    """

    max_num_tokens: int
    max_num_requests: int
    max_blocks_per_req: int
    num_heads: int
    topk: int = 2048
    max_decode_len: int = 2
    block_size: int = 64
    index_heads: int = 64
    index_dim: int = 128
    mla_fp8: bool = True
    remap: str = "topk"
    attention: str = "auto"


class DecodeInputs(NamedTuple):
    """One step's inputs (``T`` query rows, ``B`` requests, ``W`` block-table columns).

    q_idx: indexer queries ``[T, 64, 128]``, bf16 (bf16 index cache) or float8_e4m3fn (fp8
        cache; q's per-(row, head) scale folded into ``idx_weights``).
    idx_weights: fp32 ``[T, 64]`` head weights (``64^-0.5 * 128^-0.5`` folded in).
    k_idx: bf16 ``[T, 128]`` the new tokens' indexer keys.
    q: bf16 ``[T, h_q, 576]`` absorbed MLA query (``q_nope @ W_UK | q_pe``).
    kv: bf16 ``[T, 576]`` the new tokens' latent (512 ``c_kv`` | 64 ``k_pe``).
    slot_mapping: int32/int64 ``[T]`` cache slot of each new token (-1: padding, skipped).
    index_k_cache, kv_cache: the layer's caches (bf16 or fp8 formats; written in place).
    seq_lens: int32 ``[B]`` total length of each request after this step (0: padding).
    block_table: int32 ``[B, W]`` page ids shared by both caches.
    """

    q_idx: torch.Tensor
    idx_weights: torch.Tensor
    k_idx: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    slot_mapping: torch.Tensor
    index_k_cache: torch.Tensor
    kv_cache: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


class DecodeStepOutput(NamedTuple):
    """Views into the plan's buffers (the next run overwrites them).

    out: bf16 ``[T, h_q, 512]`` latent attention output (apply ``W_UV`` per head).
    lse: fp32 ``[T, h_q]`` natural-log softmax denominator.
    indices: int32 ``[T, topk]`` global slot ids attended (-1 = none); None with
    ``remap="attention"`` (the attention computes them on the fly).
    positions: int32 ``[T, topk]`` request-local positions, ascending then -1 (``remap`` not
    "topk"; else None).
    """

    out: torch.Tensor
    lse: torch.Tensor
    indices: torch.Tensor | None
    positions: torch.Tensor | None


class DecodePlan:
    """A DSA decode step for one layer at a time, with every buffer allocated once.

    The plan owns the metadata builder, the logits, top-k, slot, output and lse buffers and
    the top-k / attention workspaces; the caches and the step's inputs are the caller's. One
    plan serves every layer of a model (layers run one after another).

    :meth:`run` executes the step eagerly (any mix of ``n_b``). :meth:`capture` records the
    whole step, metadata included, as ONE CUDA graph for a fixed ``(B, n, T)`` with every
    request at the same ``n`` (the ragged metadata path stages host data and cannot be
    captured); :meth:`replay` then reruns it on whatever the captured input tensors hold.
    """

    def __init__(
        self,
        config: DecodePlanConfig,
        *,
        sm_scale: float,
        device: torch.device | str | None = None,
    ) -> None:
        c = config
        for name in ("max_num_tokens", "max_num_requests", "max_blocks_per_req", "num_heads"):
            check_int(name, getattr(c, name), lo=1)
        check_int("max_decode_len", c.max_decode_len, lo=1)
        if not supported_k(c.topk):
            raise ValueError(f"topk must be an int in [1, {MAX_K}], got {c.topk!r}")
        if c.attention not in ("auto", "torch"):
            raise ValueError(f"attention must be 'auto' or 'torch', got {c.attention!r}")
        if c.remap not in ("topk", "attention", "separate"):
            raise ValueError(f"remap must be 'topk', 'attention' or 'separate', got {c.remap!r}")
        self.config, self.sm_scale = c, float(sm_scale)
        self.device = dev = canonical_device(device)
        native = range(1, min(c.max_decode_len, MAX_NATIVE_N) + 1)
        self.builder = DecodeMetadataBuilder(
            c.max_num_tokens,
            c.max_num_requests,
            c.max_blocks_per_req,
            c.max_decode_len,
            native_decode_lens=native,
            device=dev,
        )
        t, k = c.max_num_tokens, c.topk
        max_len = c.max_blocks_per_req * c.block_size
        self._logits = torch.empty(t * max_len, dtype=torch.float32, device=dev)
        self._indices = torch.empty(t, k, dtype=torch.int32, device=dev)
        self._positions = None if c.remap == "topk" else torch.empty_like(self._indices)
        self._row_req = torch.empty(t, dtype=torch.int32, device=dev)
        # Native rows followed by CUDA-graph padding rows: the per-row lengths with 0 past
        # the B * n native rows (the builder's native lengths stop at B * n).
        self._padded_lens = torch.zeros(t, dtype=torch.int32, device=dev)
        self._arange = torch.arange(t, dtype=torch.int32, device=dev)
        self._out = torch.empty(t, c.num_heads, NOPE_DIM, dtype=torch.bfloat16, device=dev)
        self._lse = torch.empty(t, c.num_heads, dtype=torch.float32, device=dev)
        self._topk_ws = topk_workspace(t, device=dev)
        self._attn = sparse_mla_decode if c.attention == "auto" else None
        self._attn_ws = None
        if self._attn is not None:
            fmt = "fp8" if c.mla_fp8 else "bf16"
            self._attn_ws = attention_workspace(t, c.num_heads, k, cache_format=fmt, device=dev)
        if c.remap == "attention" and self._attn is None:
            raise ValueError("remap='attention' needs the library attention (attention='auto')")
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_out: DecodeStepOutput | None = None

    @property
    def attention_backend(self) -> str:
        """Which attention runs: "library" (sparse_mla_decode) or "torch" (batched PyTorch)."""
        return "library" if self._attn is not None else "torch"

    # ---- the stages ---------------------------------------------------------------------

    def _metadata(self, x: DecodeInputs, decode_lens: Sequence[int], num_tokens: int):
        meta = self.builder.build(x.seq_lens, x.block_table, decode_lens, num_tokens=num_tokens)
        if not meta.flattened and num_tokens > meta.num_tokens:
            # Native layout (all n_b equal) with padding rows: the builder produced B * n
            # lengths; padding rows see nothing (length 0), as in the flattened layout.
            native = meta.num_tokens
            self._padded_lens[:native].copy_(meta.seq_lens.reshape(native))
            self._padded_lens[native:num_tokens].zero_()
        return meta

    def _write_caches(self, x: DecodeInputs) -> None:
        write_indexer_k(x.k_idx, x.index_k_cache, x.slot_mapping)
        write_mla_latent(x.kv[:, :NOPE_DIM], x.kv[:, NOPE_DIM:], x.kv_cache, x.slot_mapping)

    def _score(self, x: DecodeInputs, meta: DecodeMetadata, max_len: int) -> torch.Tensor:
        """Indexer logits ``[T, max_len]`` (every step row; padding rows past the native
        ``B * n`` are left unwritten: their length is 0, so top-k never reads them)."""
        rows, scored = x.q_idx.shape[0], meta.num_tokens
        logits = self._logits[: rows * max_len].view(rows, max_len)
        if meta.flattened:
            index_logits(
                x.q_idx, x.idx_weights, x.index_k_cache, meta.seq_lens, meta.block_table,
                max_len=max_len, out=logits,
            )  # fmt: skip
            return logits
        q, w, out = x.q_idx, x.idx_weights, logits
        if scored < rows:  # native rows, then padding rows (sliced only then: host cost)
            q, w, out = q[:scored], w[:scored], logits[:scored]
        index_logits(
            q, w, x.index_k_cache, x.seq_lens, x.block_table,
            next_n=meta.next_n, max_len=max_len, out=out,
        )  # fmt: skip
        return logits

    def _selection(self, meta: DecodeMetadata, rows: int) -> _Selection:
        """Views of this step's selection buffers for ``rows`` step rows (nothing launched)."""
        if meta.flattened:
            lens, req = meta.seq_lens, meta.req_id
        elif rows == meta.num_tokens:  # native rows b * n + j: lengths [B, n] row-major
            lens, req = meta.seq_lens.reshape(rows), self._row_req[:rows]
        else:  # native rows, then padding rows of length 0 (filled by _metadata)
            lens, req = self._padded_lens[:rows], self._row_req[:rows]
        slots = None if self.config.remap == "attention" else self._indices[:rows]
        pos = None if self._positions is None else self._positions[:rows]
        return _Selection(lens, req, slots, pos)

    def _select(self, x: DecodeInputs, meta: DecodeMetadata, logits: torch.Tensor) -> _Selection:
        c, sel, ws = self.config, self._selection(meta, logits.shape[0]), self._topk_ws
        if not meta.flattened:  # request = row // n (padding rows get req >= B: remapped to -1)
            torch.div(self._arange[: sel.req.shape[0]], meta.next_n, rounding_mode="floor",
                      out=sel.req)  # fmt: skip
        if sel.positions is None:  # remap "topk": slots straight from the top-k epilogue
            remap = {"block_table": x.block_table, "req_id": sel.req, "block_size": c.block_size}
            select_topk(logits, sel.lens, k=c.topk, out=sel.slots, workspace=ws, **remap)
            return sel
        select_topk(logits, sel.lens, k=c.topk, out=sel.positions, workspace=ws)
        if sel.slots is not None:  # remap "separate"
            convert_req_index_to_global_index(
                sel.req, x.block_table, sel.positions, block_size=c.block_size, out=sel.slots
            )
        return sel

    def _attend(self, x: DecodeInputs, sel: _Selection):
        rows = sel.lens.shape[0]
        out, lse = self._out[:rows], self._lse[:rows]
        if self._attn is None:
            return sparse_attention_torch(
                x.q, x.kv_cache, sel.slots, self.sm_scale, out=out, lse=lse
            )
        common = {"sm_scale": self.sm_scale, "out": out, "lse": lse, "workspace": self._attn_ws}
        if sel.slots is not None:
            return self._attn(x.q, x.kv_cache, sel.slots, **common)
        return self._attn(x.q, x.kv_cache, sel.positions, block_table=x.block_table,
                          req_id=sel.req, block_size=self.config.block_size, **common)  # fmt: skip

    # ---- eager ----------------------------------------------------------------------------

    def run(
        self,
        inputs: DecodeInputs,
        decode_lens: Sequence[int],
        *,
        num_tokens: int | None = None,
        max_seq_len: int | None = None,
        stage_times: dict[str, float] | None = None,
    ) -> DecodeStepOutput:
        """Run one step eagerly.

        Args:
            inputs: :class:`DecodeInputs` with ``T = num_tokens`` rows.
            decode_lens: host-known ``n_b`` of each request (``sum <= T``; all equal and
                ``<= 8`` keeps the indexer's native multi-token rows, else rows are flattened).
            num_tokens: rows including padding (default ``sum(decode_lens)``). Padding rows
                come after the requests' rows, in either layout, and see nothing: indices -1,
                out 0, lse ``-inf`` (their ``slot_mapping`` entries should be -1).
            max_seq_len: host bound on ``seq_lens`` (columns of the logits; default the block
                table's capacity). Positions past it are never selected.
            stage_times: when given, each stage is synchronised and its wall time in seconds
                added under its name in :data:`STAGES` (for the demo's table).
        """
        c = self.config
        rows = sum(decode_lens) if num_tokens is None else num_tokens
        self._check(inputs, decode_lens, rows)
        max_len = inputs.block_table.shape[1] * c.block_size
        if max_seq_len is not None:
            check_int("max_seq_len", max_seq_len, lo=0)
            max_len = min(max_len, -(-max_seq_len // c.block_size) * c.block_size)
        clock = _StageClock(stage_times, self.device)
        meta = clock("metadata", self._metadata, inputs, decode_lens, rows)
        clock("cache writes", self._write_caches, inputs)
        logits = clock("logits", self._score, inputs, meta, max_len)
        sel = clock("top-k", self._select, inputs, meta, logits)
        out, lse = clock("attention", self._attend, inputs, sel)
        return DecodeStepOutput(out, lse, sel.slots, sel.positions)

    def stage_calls(
        self, inputs: DecodeInputs, decode_lens: Sequence[int], *, num_tokens: int | None = None
    ) -> dict[str, Callable[[], object]]:
        """Each stage of the step as a no-argument call on this plan's buffers, in
        :data:`STAGES` order, for timing them one by one (e.g. one CUDA graph each). Runs the
        metadata stage once eagerly so the later stages have their inputs."""
        rows = sum(decode_lens) if num_tokens is None else num_tokens
        self._check(inputs, decode_lens, rows)
        max_len = inputs.block_table.shape[1] * self.config.block_size
        meta = self._metadata(inputs, decode_lens, rows)
        logits = self._logits[: rows * max_len].view(rows, max_len)
        sel = self._selection(meta, rows)
        return {
            "metadata": lambda: self._metadata(inputs, decode_lens, rows),
            "cache writes": lambda: self._write_caches(inputs),
            "logits": lambda: self._score(inputs, meta, max_len),
            "top-k": lambda: self._select(inputs, meta, logits),
            "attention": lambda: self._attend(inputs, sel),
        }

    def _check(self, x: DecodeInputs, decode_lens: Sequence[int], rows: int) -> None:
        c = self.config
        check_int("num_tokens", rows, lo=0, hi=c.max_num_tokens)
        if x.q.dim() != 3 or x.q.shape[1:] != (c.num_heads, LATENT_DIM):
            raise ValueError(f"q must be [T, {c.num_heads}, {LATENT_DIM}], got {tuple(x.q.shape)}")
        for name in ("q_idx", "idx_weights", "k_idx", "q", "kv", "slot_mapping"):
            t = getattr(x, name)
            if t.shape[0] != rows:
                raise ValueError(f"{name} has {t.shape[0]} rows, the step has {rows}")
        if (x.kv_cache.dtype == torch.uint8) != c.mla_fp8:
            want = "fp8 (uint8)" if c.mla_fp8 else "bf16"
            raise ValueError(f"kv_cache is {x.kv_cache.dtype}; the plan was sized for {want}")
        for name in ("kv_cache", "index_k_cache"):  # both [pages, page, ...]
            cache = getattr(x, name)
            if cache.dim() >= 2 and cache.shape[1] != c.block_size:
                raise ValueError(
                    f"{name} has pages of {cache.shape[1]} tokens (shape {tuple(cache.shape)}) "
                    f"but the plan's block_size is {c.block_size}: slots and block-table pages "
                    "would be computed for the wrong page size"
                )
        if x.kv.dim() != 2 or x.kv.shape[1] != LATENT_DIM:
            raise ValueError(f"kv must be [T, {LATENT_DIM}], got {tuple(x.kv.shape)}")
        if len(decode_lens) != x.seq_lens.shape[0]:
            raise ValueError(
                f"decode_lens has {len(decode_lens)} entries, seq_lens {x.seq_lens.shape[0]}"
            )

    # ---- one CUDA graph ---------------------------------------------------------------------

    def capture(
        self, inputs: DecodeInputs, decode_len: int, *, warmup: int = 2
    ) -> DecodeStepOutput:
        """Capture the whole step as one CUDA graph (CUDA only).

        Every request has ``decode_len`` query tokens (``T = B * decode_len``; padding
        requests have ``seq_lens = 0``). The tensors in ``inputs`` become the graph's inputs:
        refill them in place (new lengths, block tables, queries, slots) before each
        :meth:`replay`. Runs the step ``warmup`` times eagerly first (compilation, lazy
        state), so the caches receive the inputs' writes.

        Returns:
            the :class:`DecodeStepOutput` views every replay rewrites.
        """
        if self.device.type != "cuda":
            raise RuntimeError("capture() needs a CUDA device; use run() elsewhere")
        b = inputs.seq_lens.shape[0]
        lens = [decode_len] * b
        if decode_len > min(self.config.max_decode_len, MAX_NATIVE_N):
            raise ValueError(
                f"decode_len={decode_len}: a captured step takes the native layout "
                f"(n <= {min(self.config.max_decode_len, MAX_NATIVE_N)})"
            )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.run(inputs, lens)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):  # the stream the warm-up ran on
            result = self.run(inputs, lens)
        self._graph, self._graph_out = graph, result
        return result

    def replay(self) -> DecodeStepOutput:
        """Replay the captured step (no allocation, no host sync)."""
        if self._graph is None or self._graph_out is None:
            raise RuntimeError("replay() before capture()")
        self._graph.replay()
        return self._graph_out


class _Selection(NamedTuple):
    """One step's top-k views: per-row visible lengths and block-table rows, the slots
    (None when the attention remaps) and the positions (None when top-k writes slots)."""

    lens: torch.Tensor
    req: torch.Tensor
    slots: torch.Tensor | None
    positions: torch.Tensor | None


class _StageClock:
    """Calls a stage; with a dict, synchronises around it and accumulates its wall time."""

    def __init__(self, times: dict[str, float] | None, device: torch.device) -> None:
        self.times, self.cuda = times, device.type == "cuda"

    def __call__(self, name: str, fn: Callable, *args):
        if self.times is None:
            return fn(*args)
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn(*args)
        if self.cuda:
            torch.cuda.synchronize()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        return result
