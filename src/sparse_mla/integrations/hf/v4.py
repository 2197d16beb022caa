"""Hugging Face transformers' DeepSeek-V4 (``DeepseekV4ForCausalLM``) through sparse-mla.

:func:`enable` replaces the forward of every ``DeepseekV4Attention`` (sliding-window, CSA and
HCA layers alike, per ``config.layer_types`` and ``config.compress_rates``) with the library's
V4 decode step (:class:`sparse_mla.decode.V4DecodePlan`, one plan per layer kind):

* the projections stay the layer's own modules (``q_a_proj``, ``q_a_norm``, ``q_b_proj``,
  ``q_b_norm``, ``kv_proj``, ``kv_norm``, HF's interleaved RoPE on the trailing 64 dims; the
  compressors' ``kv_proj`` / ``gate_proj``; the indexer's ``q_b_proj`` with its own RoPE and
  its scorer's ``weights_proj``), and so do ``o_a_proj`` / ``o_b_proj`` after;
* the step writes the window row into a paged *window cache* (MODEL1 rows), runs the
  compressors (``compressor_decode``: CSA's and its indexer's, or HCA's) into paged
  *compressed caches* through their per-request rings, selects CSA's top-k with the indexer
  (``index_logits``, ``select_topk``), attends over the window and the compressed entries in
  one softmax with the per-head sink (``sparse_mla_decode``) and undoes the output's RoPE;
* prefill has no kernel of its own: the prompt is stepped through the same plan,
  ``prefill_chunk`` tokens per request a step (MTP-style rows, each its own causal window and
  top-k), which is what a V4 prefill computes.

Caches (per layer, bf16 or fp8 MODEL1 rows): the window cache is a ring of pages per request
(``window + prefill_chunk - 1`` tokens, page-aligned) addressed by absolute position through a
block table whose columns repeat the ring, so it stays the same size however long the
sequence grows; the compressed caches grow a page at a time, one block table per layer kind
(CSA's attention and indexer caches share theirs). HF's own cache object only counts tokens
(one scalar per token and layer), so ``generate``'s positions and masks work unchanged; HF's
compressors, dense window and eager attention never run.

Supported: greedy / sampled generation, batches of requests of one length (no padding), beam
search (the cache's ``reorder_cache``, which ``generate`` calls after each step, copies every
beam's window pages, compressed pages and compressor rings from the beam it continues).
Refused at the forward: a padded batch (an attention mask with a masked token; transformers'
own V4 compresses padding tokens into its entries, so there is no reference to match).
Not followed: ``Cache.batch_select_indices`` / ``batch_repeat_interleave`` on a filled cache.

Requirements (checked at :func:`enable`): transformers ``>= 5.24`` (``TRANSFORMERS`` is the
tested range); ``head_dim`` 512 with 64 RoPE dims (``partial_rotary_factor`` 1/8),
``index_head_dim`` 128 and ``index_topk`` a top-k size the kernels take (CSA layers), at most
128 heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..._runtime import next_pow2
from ...decode.v4_naive import V4_DIM, V4_ROPE, V4Compressor, V4StepInputs
from ...decode.v4_plan import V4DecodePlan, V4DecodePlanConfig
from ...ops.attention.config import MAX_HEADS
from ...ops.compressor import CompressorState, new_compressor_state
from ...ops.compressor.api import MAX_DECODE_LEN as MAX_RING_STEP
from ...ops.indexer import quantize_index_q
from ...ops.kv_cache import new_indexer_k_cache, new_mla_cache
from ...ops.topk import MAX_K, supported_k
from ._common import (
    PagePool,
    attention_layers,
    beam_sources,
    check_common_options,
    check_layer_parts,
    check_version,
    count_tokens,
    follow_reorders,
    grown_cache,
    import_modeling,
    missing_cache_keyword,
    patch_forwards,
    raise_missing_features,
)

KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
         "heavily_compressed_attention": "hca"}  # fmt: skip
INDEX_DIM = 128
# What the replaced forward reads from each DeepseekV4Attention, per layer kind.
LAYER_PARTS = (
    "layer_idx", "layer_type", "rope_layer_type", "num_heads", "head_dim", "scaling",
    "sliding_window", "config.o_groups", "q_a_proj", "q_a_norm", "q_b_proj", "q_b_norm",
    "kv_proj", "kv_norm", "o_a_proj", "o_b_proj", "sinks", "compressor",
)  # fmt: skip
COMPRESSOR_PARTS = tuple(
    f"compressor.{p}" for p in ("kv_proj", "gate_proj", "position_bias", "kv_norm.weight",
                                "compress_rate")
)  # fmt: skip
INDEXER_PARTS = tuple(
    f"compressor.indexer.{p}" for p in (
        "kv_proj", "gate_proj", "position_bias", "kv_norm.weight", "q_b_proj", "rotary_emb",
        "rope_layer_type", "head_dim", "scorer.weights_proj", "scorer.weights_scaling",
        "scorer.softmax_scale",
    )
)  # fmt: skip


@dataclass
class _LayerState:
    """One layer's caches and compressor rings (``cmp``: CSA's / HCA's, ``idx``: CSA's
    indexer's)."""

    window: torch.Tensor
    cmp_cache: torch.Tensor | None = None
    idx_cache: torch.Tensor | None = None
    cmp_ring: CompressorState | None = None
    idx_ring: CompressorState | None = None

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The paged caches by page pool, and the rings (indexed by request)."""
        return {
            "window": [self.window],
            "compressed": [c for c in (self.cmp_cache, self.idx_cache) if c is not None],
            "rings": [t for r in (self.cmp_ring, self.idx_ring) if r is not None for t in r],
        }


@dataclass
class SparseMlaV4State:
    """What :func:`enable` attaches to a V4 model (``model.sparse_mla``).

    fp8: MODEL1 fp8 caches (window and compressed), an fp8 indexer cache and fp8 indexer
    queries; block_size: tokens per page (every cache); prefill_chunk: prompt tokens per
    request and step; record_topk: keep each CSA layer's selected compressed positions of
    every forward in ``topk[layer_idx]`` (a list of int32 ``[B, S, index_topk]``,
    request-local entry indices, -1 padded). ``window``, ``rates``: the config's sliding
    window and compress rate per layer kind; ``rotary``: the model's RoPE module, whose
    tables the compressors and the output's inverse RoPE read.
    """

    fp8: bool
    block_size: int
    prefill_chunk: int
    record_topk: bool
    window: int
    rates: dict[str, int]
    rotary: torch.nn.Module
    topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    layers: dict[int, _LayerState] = field(default_factory=dict)
    pools: dict[str, PagePool] = field(
        default_factory=lambda: {k: PagePool() for k in ("window", "csa", "hca")}
    )
    plans: dict[tuple[str, int], V4DecodePlan] = field(default_factory=dict)
    batch: int = 0
    _kinds: dict[int, str] = field(default_factory=dict, repr=False)  # layer -> kind
    _tables: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _step_memo: dict = field(default_factory=dict, repr=False)
    _mask_memo: tuple | None = field(default=None, repr=False)

    @property
    def cache_format(self) -> str:
        return "model1_fp8" if self.fp8 else "model1_bf16"

    @property
    def ring_pages(self) -> int:
        """Window pages per request: the window plus a step's other rows, page-aligned."""
        return -(-(self.window + self.prefill_chunk - 1) // self.block_size)

    def reset(self, batch: int) -> None:
        """Forget every sequence (a new batch of ``batch`` requests); caches are kept."""
        self.batch = batch
        self._step_memo.clear()
        for pool in self.pools.values():
            pool.reset(batch)
        self.pools["window"].grow(self.ring_pages)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Request ``i`` continues request ``beam_idx[i]`` (beam search): its window pages,
        compressed pages and compressor rings get that request's. Every request holds as
        many pages of each pool, so the block tables stay as they are."""
        src = beam_sources(beam_idx, self.batch)
        if src is None:
            return
        for idx, layer in self.layers.items():
            parts = layer.tensors()
            self.pools["window"].copy_requests(src, parts["window"])
            if parts["compressed"]:
                self.pools[self._kinds[idx]].copy_requests(src, parts["compressed"])
            for ring in parts["rings"]:
                ring.copy_(ring[src])

    def _start(self, layer: int, batch: int, past: int) -> None:
        """A new batch starts at the first layer's forward with an empty HF cache."""
        if past == 0 and (layer == min(self._kinds) or self.batch != batch):
            self.reset(batch)
        elif self.batch != batch:
            raise ValueError(
                f"this forward has {batch} rows but the paged caches hold {self.batch} "
                "requests: only Cache.reorder_cache is followed (batch_select_indices / "
                "batch_repeat_interleave on a filled cache are not supported)"
            )

    def _check_unpadded(self, mask: torch.Tensor | None, seq: int) -> None:
        """ValueError when HF's 4-D mask masks one of this forward's own tokens (each new
        token sees itself unless it is padding: the diagonal of the last ``seq`` keys). Read
        once per forward (every layer gets the same mask object): one device-to-host copy."""
        if mask is None or mask.dim() != 4:
            return
        memo = self._mask_memo
        if memo is not None and memo[0] is mask:
            return
        own = mask[:, 0, :, -seq:].diagonal(dim1=-2, dim2=-1)
        if own.dtype == torch.bool:
            real = own
        elif own.is_floating_point():
            real = own == 0  # additive: 0 attends, the dtype's min masks
        else:
            real = own != 0
        if not bool(real.all()):
            raise ValueError(
                "sparse-mla's DeepSeek-V4 integration takes batches without padding (an "
                "attention_mask with zeros): transformers' own V4 compresses padding tokens "
                "into its entries, so a padded batch has no reference; generate requests of "
                "different lengths one at a time"
            )
        self._mask_memo = (mask,)  # holds the mask: its id cannot be reused

    def _layer(self, attn, x: dict[str, torch.Tensor]) -> _LayerState:
        """The layer's caches (grown to the pools' pages) and rings (sized for the batch)."""
        kind, dev, page = self._kinds[attn.layer_idx], x["q"].device, self.block_size
        fmt, old = self.cache_format, self.layers.get(attn.layer_idx)

        def mla(n: int) -> torch.Tensor:
            return new_mla_cache(n, page, format=fmt, device=dev)

        st = _LayerState(grown_cache(old and old.window, self.pools["window"].held(), mla))
        if kind != "sliding":
            st.cmp_cache = grown_cache(old and old.cmp_cache, self.pools[kind].held(), mla)
            st.cmp_ring = self._ring(old and old.cmp_ring, x["cmp_kv"], x["cmp_gate"], kind)
        if kind == "csa":
            st.idx_cache = grown_cache(
                old and old.idx_cache, self.pools["csa"].held(),
                lambda n: new_indexer_k_cache(n, page, head_dim=INDEX_DIM, fp8=self.fp8,
                                              device=dev),
            )  # fmt: skip
            st.idx_ring = self._ring(old and old.idx_ring, x["idx_kv"], x["idx_gate"], kind)
        self.layers[attn.layer_idx] = st
        return st

    def _ring(self, old, kv: torch.Tensor, gate: torch.Tensor, kind: str) -> CompressorState:
        """A compressor's rings: one per request, rows for a step of ``prefill_chunk``."""
        if old is not None and old.kv.shape[0] == self.batch and old.kv.dtype == kv.dtype:
            return old
        return new_compressor_state(
            self.batch, kv.shape[-1], compress_rate=self.rates[kind], overlap=kind == "csa",
            max_decode_len=self.prefill_chunk, dtype=kv.dtype, gate_dtype=gate.dtype,
            device=kv.device,
        )  # fmt: skip

    def _step_tensors(self, kind: str, length: int, n: int, device) -> dict[str, torch.Tensor]:
        """A step's device metadata, made once per step and shared by its layers:
        ``seq_lens``, ``query_start_loc``, the window block table (column ``c`` of request
        ``b`` is page ``ring[b][c % ring_pages]``: the ring repeats, a window never spans
        more) and ``kind``'s compressed block table (its pool grown to ``length``)."""
        if kind != "sliding":
            entries = length // self.rates[kind]
            self.pools[kind].grow(max(1, -(-entries // self.block_size)))
        key = (self.batch, length, n, device, self.pools["csa"].count, self.pools["hca"].count)
        memo = self._step_memo
        if memo.get("key") != key:
            b, ring = self.batch, self.pools["window"].table()
            cols = torch.arange(-(-length // self.block_size)) % ring.shape[1]
            memo.clear()
            memo.update(
                key=key, window=ring[:, cols].to(device),
                seq_lens=torch.full((b,), length, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device) * n,
            )  # fmt: skip
        if kind != "sliding" and kind not in memo:
            memo[kind] = self.pools[kind].table().to(device)
        return memo

    def _rope_table(self, rope: str, length: int, like: torch.Tensor) -> torch.Tensor:
        """``[>= length, 64]`` cos | sin of RoPE type ``rope`` ("main" / "compress") per
        position, as HF computes them for the model's dtype (grown by doubling)."""
        t = self._tables.get(rope)
        if t is None or t.shape[0] < length or (t.device, t.dtype) != (like.device, like.dtype):
            n = max(length, 2 * t.shape[0] if t is not None else 256)
            pos = torch.arange(n, device=like.device)[None]
            cos, sin = self.rotary(like, pos, layer_type=rope)
            self._tables[rope] = t = torch.cat([cos[0], sin[0]], -1)
        return t

    def _plan(self, attn, kind: str, batch: int, n: int, compressed: int) -> V4DecodePlan:
        """The plan of ``kind`` for steps of up to ``n`` rows a request (1: decode; else a
        power of two up to ``prefill_chunk``), grown to ``batch`` requests and
        ``compressed`` entries a request."""
        cap = 1 if n == 1 else min(next_pow2(n), self.prefill_chunk)
        p = self.plans.get((kind, cap))
        if (
            p is not None
            and p.config.max_num_requests >= batch
            and (p.config.max_compressed >= compressed)
        ):
            return p
        old = p.config if p is not None else None
        reqs = max(batch, old.max_num_requests if old else 0)
        cfg = V4DecodePlanConfig(
            kind, max_num_tokens=reqs * cap, max_num_requests=reqs, num_heads=attn.num_heads,
            max_decode_len=cap, window=self.window, compress_rate=self.rates.get(kind, 1),
            max_compressed=max(compressed, 2 * old.max_compressed if old else 1),
            topk=attn.config.index_topk, index_heads=attn.config.index_n_heads,
            index_dim=INDEX_DIM, cache_format=self.cache_format, eps=attn.config.rms_norm_eps,
        )  # fmt: skip
        self.plans[kind, cap] = p = V4DecodePlan(cfg, sm_scale=attn.scaling,
                                                 device=attn.sinks.device)  # fmt: skip
        return p


def check_config(config) -> None:
    """Raise ValueError when the model's attention sizes are ones the kernels do not take."""
    rope = int(config.head_dim * config.partial_rotary_factor)
    for name, got, want in (("head_dim", config.head_dim, V4_DIM),
                            ("head_dim * partial_rotary_factor", rope, V4_ROPE)):  # fmt: skip
        if got != want:
            raise ValueError(
                f"sparse-mla needs config.{name} == {want} (MODEL1 rows: 448 + 64 RoPE), got {got}"
            )
    if not 1 <= config.num_attention_heads <= MAX_HEADS:
        raise ValueError(f"sparse-mla needs 1..{MAX_HEADS} attention heads, got "
                         f"{config.num_attention_heads}")  # fmt: skip
    if "compressed_sparse_attention" not in config.layer_types:
        return
    if config.index_head_dim != INDEX_DIM:
        raise ValueError(f"sparse-mla needs config.index_head_dim == {INDEX_DIM} (CSA layers), "
                         f"got {config.index_head_dim}")  # fmt: skip
    if not supported_k(config.index_topk):
        raise ValueError(f"sparse-mla needs config.index_topk to be an int in [1, {MAX_K}], "
                         f"got {config.index_topk!r}")  # fmt: skip


def check_features() -> None:
    """Raise RuntimeError unless the installed transformers' DeepseekV4 takes ``cache=`` and
    has the helpers used here."""
    m = import_modeling("deepseek_v4", "DeepseekV4")
    takes_cache = {
        "DeepseekV4Attention.forward(cache=)": m.DeepseekV4Attention.forward,
        "DeepseekV4Model.forward(cache=)": m.DeepseekV4Model.forward,
    }
    helpers = ("apply_rotary_pos_emb", "DeepseekV4RotaryEmbedding")
    missing = missing_cache_keyword(takes_cache)
    raise_missing_features("DeepseekV4", missing + [h for h in helpers if not hasattr(m, h)])


def _check_layers(layers: list[torch.nn.Module]) -> None:
    """Every layer kind's first layer has what the replaced forward reads."""
    seen = set()
    for layer in layers:
        check_layer_parts(layer, ("layer_type",))
        kind = KINDS.get(layer.layer_type)
        if kind is None:
            raise ValueError(f"layer {getattr(layer, 'layer_idx', '?')} has layer_type "
                             f"{layer.layer_type!r}, not one of {sorted(KINDS)}")  # fmt: skip
        if kind in seen:
            continue
        seen.add(kind)
        parts = LAYER_PARTS + (COMPRESSOR_PARTS if kind != "sliding" else ())
        check_layer_parts(layer, parts + (INDEXER_PARTS if kind == "csa" else ()))


def enable(
    model: torch.nn.Module,
    *,
    fp8: bool = False,
    block_size: int = 64,
    prefill_chunk: int = 256,
    record_topk: bool = False,
) -> torch.nn.Module:
    """Route every ``DeepseekV4Attention`` of ``model`` through sparse-mla; returns ``model``.

    Args:
        model: a ``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` (any dtype, any device the
            kernels run on). Weights may change later (the projections are read each step).
        fp8: MODEL1 fp8 window and compressed caches, an fp8 indexer cache and fp8 indexer
            queries; default bf16 caches.
        block_size: tokens per cache page, an int in ``[1, 2**20]``.
        prefill_chunk: prompt tokens per request taken by one step (sizes the compressor
            rings and the window ring), an int in ``[1, 65535]``.
        record_topk: keep each CSA layer's selected entries (see :class:`SparseMlaV4State`).

    Raises:
        RuntimeError: the installed transformers is not one this module was written for, or
            its attention layers lack a part the replaced forward reads (:data:`LAYER_PARTS`
            and the compressors' / indexer's).
        TypeError: ``model`` holds no ``DeepseekV4Attention``; an option has the wrong type.
        ValueError: an option is out of range; the config has sizes the kernels do not take
            (see module notes); a layer's ``layer_type`` is none of :data:`KINDS`.
    """
    check_version(stacklevel=4)
    check_features()
    m = import_modeling("deepseek_v4", "DeepseekV4")
    layers = attention_layers(model, m.DeepseekV4Attention)
    _check_layers(layers)
    check_common_options(block_size, prefill_chunk, MAX_RING_STEP, fp8=fp8, record_topk=record_topk)
    check_config(model.config)
    cfg = model.config
    rotary = next((x for x in model.modules() if isinstance(x, m.DeepseekV4RotaryEmbedding)), None)
    if rotary is None:  # a module holding the layers but not the model's rotary
        rotary = m.DeepseekV4RotaryEmbedding(cfg).to(layers[0].sinks.device)
    state = SparseMlaV4State(
        fp8=fp8, block_size=block_size, prefill_chunk=prefill_chunk, record_topk=record_topk,
        window=cfg.sliding_window, rotary=rotary,
        rates={KINDS[k]: r for k, r in cfg.compress_rates.items() if k in KINDS},
    )  # fmt: skip
    state._kinds = {x.layer_idx: KINDS[x.layer_type] for x in layers}
    patch_forwards(model, m.DeepseekV4Attention, _make_forward(state, m))
    model.sparse_mla = state
    return model


def _make_forward(state: SparseMlaV4State, m):
    def forward(self, hidden_states, position_embeddings, position_ids=None,
                attention_mask=None, cache=None, **kwargs):  # fmt: skip
        del kwargs
        batch, seq, _ = hidden_states.shape
        if cache is not None:
            follow_reorders(cache, state)
        past = count_tokens(cache, self.layer_idx, hidden_states)
        state._check_unpadded(attention_mask, seq)
        state._start(self.layer_idx, batch, past)
        x = _project(self, hidden_states, position_embeddings, position_ids, m, state.fp8)
        out = torch.empty(batch, seq, self.num_heads, V4_DIM, dtype=torch.bfloat16,
                          device=hidden_states.device)  # fmt: skip
        if state.record_topk and state._kinds[self.layer_idx] == "csa":
            k = self.config.index_topk
            state.topk.setdefault(self.layer_idx, []).append(
                torch.full((batch, seq, k), -1, dtype=torch.int32, device=out.device)
            )
        for s0 in range(0, seq, state.prefill_chunk):
            _step(self, state, x, past, s0, min(seq, s0 + state.prefill_chunk), out)
        grouped = out.to(hidden_states.dtype).view(batch, seq, self.config.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped).flatten(2)), None

    return forward


def _project(attn, h: torch.Tensor, position_embeddings, position_ids, m,
             fp8: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """The step's inputs of every token, ``[B, S, ...]``, from the layer's own modules (the
    ops transformers' ``DeepseekV4Attention`` runs before its attention, in its order)."""
    b, s, _ = h.shape
    cos, sin = position_embeddings[attn.rope_layer_type]
    q_res = attn.q_a_norm(attn.q_a_proj(h))
    q = attn.q_b_norm(attn.q_b_proj(q_res).view(b, s, -1, attn.head_dim).transpose(1, 2))
    q = m.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [B, S, h, 512]
    kv = attn.kv_norm(attn.kv_proj(h)).view(b, 1, s, attn.head_dim)
    kv = m.apply_rotary_pos_emb(kv, cos, sin)[:, 0]  # [B, S, 512]
    x = {"q": q.bfloat16(), "kv": kv.bfloat16()}
    c = attn.compressor
    if c is None:
        return x
    x |= {"cmp_kv": c.kv_proj(h), "cmp_gate": c.gate_proj(h)}
    ix = getattr(c, "indexer", None)
    if ix is None:
        return x
    if position_ids is None:
        cq, sq = position_embeddings[ix.rope_layer_type]
    else:  # the indexer's own rotary, as transformers calls it
        cq, sq = ix.rotary_emb(h, position_ids=position_ids, layer_type=ix.rope_layer_type)
    qi = ix.q_b_proj(q_res).view(b, s, -1, ix.head_dim).transpose(1, 2)
    qi = m.apply_rotary_pos_emb(qi, cq, sq).transpose(1, 2)  # [B, S, H, 128]
    sc = ix.scorer  # relu(q.k) * c1 * (w * c2) == relu(q.k) * (w * c1 * c2), c1 > 0
    w = sc.weights_proj(h).float() * (sc.weights_scaling * sc.softmax_scale)
    qi, w = quantize_index_q(qi.float(), w) if fp8 else (qi.bfloat16(), w)
    return x | {"idx_kv": ix.kv_proj(h), "idx_gate": ix.gate_proj(h), "q_idx": qi,
                "idx_weights": w}  # fmt: skip


def _step(attn, state: SparseMlaV4State, x: dict, past: int, s0: int, s1: int,
          out: torch.Tensor) -> None:  # fmt: skip
    """Tokens ``[s0, s1)`` of every request as one step of the layer's plan, written into
    ``out`` (bf16 ``[B, S, h, 512]``)."""
    b, n, dev = out.shape[0], s1 - s0, out.device
    kind, length = state._kinds[attn.layer_idx], past + s1
    rows = {k: v[:, s0:s1].flatten(0, 1) for k, v in x.items()}
    meta = state._step_tensors(kind, length, n, dev)
    compressed, cmp, idx, extra = 1, None, None, {}
    if kind != "sliding":
        compressed = meta[kind].shape[1] * state.block_size
        extra = {"cmp_kv": rows["cmp_kv"], "cmp_gate": rows["cmp_gate"],
                 "compressed_block_table": meta[kind]}  # fmt: skip
    layer = state._layer(attn, x)
    like = attn.kv_proj.weight  # HF's RoPE tables are in the model's dtype
    cos_sin = state._rope_table("compress", length, like)
    if kind != "sliding":
        c = attn.compressor
        cmp = V4Compressor(*layer.cmp_ring, layer.cmp_cache, c.position_bias,
                           c.kv_norm.weight, cos_sin)  # fmt: skip
    if kind == "csa":
        ix = attn.compressor.indexer
        idx = V4Compressor(*layer.idx_ring, layer.idx_cache, ix.position_bias,
                           ix.kv_norm.weight, cos_sin)  # fmt: skip
        extra |= {k: rows[k] for k in ("idx_kv", "idx_gate", "q_idx", "idx_weights")}
    inputs = V4StepInputs(
        rows["q"], rows["kv"], layer.window, meta["window"], meta["seq_lens"],
        meta["query_start_loc"], state._rope_table(attn.rope_layer_type, length, like),
        attn.sinks, **extra,
    )  # fmt: skip
    plan = state._plan(attn, kind, b, n, compressed)
    res = plan.run(inputs, compressor=cmp, indexer=idx)
    out[:, s0:s1] = res.out.view(b, n, *out.shape[2:])
    if state.record_topk and kind == "csa":
        state.topk[attn.layer_idx][-1][:, s0:s1] = res.compressed.view(b, n, -1)


def tiny_config(**overrides):
    """A small ``DeepseekV4Config`` with the real row layout (512 = 448 + 64 RoPE, a 128-wide
    indexer) and small everything else: three layers (sliding, CSA at rate 4, HCA at rate 8),
    window 8, 2 heads, index_topk 3, hash-routed MoE everywhere (its expert choice depends on
    the token ids alone, so rounding cannot flip it); ``overrides`` win."""
    from transformers import DeepseekV4Config

    base = {
        "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 2, "head_dim": 512, "partial_rotary_factor": 64 / 512,
        "q_lora_rank": 32, "o_groups": 1, "o_lora_rank": 16, "sliding_window": 8,
        "index_n_heads": 8, "index_head_dim": 128, "index_topk": 3,
        "layer_types": list(KINDS),
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe"] * 3, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }  # fmt: skip
    base.update(overrides)
    return DeepseekV4Config(**base)


def flash_layer_config(num_hidden_layers: int = 4, **overrides):
    """DeepSeek-V4-Flash's attention layers (hidden 4096, 64 heads, q_lora 1024, 8 output
    groups of rank 1024, a 64 x 128 indexer keeping 512, window 128, rates 4 and 128) with a
    small vocabulary and MoE; layers cycle sliding, CSA, HCA (all three kinds from 3 on)."""
    cycle = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    kinds = [cycle[i % 3] for i in range(num_hidden_layers)]
    base = {
        "vocab_size": 4096, "hidden_size": 4096, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "index_n_heads": 64, "index_topk": 512, "layer_types": kinds,
        "compress_rates": {"compressed_sparse_attention": 4,
                           "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe"] * num_hidden_layers, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "max_position_embeddings": 65536,
    }  # fmt: skip
    base.update(overrides)
    return tiny_config(**base)


def random_model(config=None, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random ``DeepseekV4ForCausalLM`` (eval mode, eager attention) from ``config``
    (default :func:`tiny_config`), transformers' fp32 modules kept fp32. Weights from
    ``seed``, scaled so that every part matters: linear weights ``N(0, 1/fan_in)``, norm
    weights ``1 + N(0, 0.01)``, sinks and position biases ``N(0, 1)``, embeddings ``N(0, 1)``,
    random hash routes (mHC and experts keep transformers' init)."""
    from transformers import DeepseekV4ForCausalLM

    config = tiny_config() if config is None else config
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias")) or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and ("self_attn" in name or "lm_head" in name):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, config.n_routed_experts, b.shape, generator=gen))
    return model
