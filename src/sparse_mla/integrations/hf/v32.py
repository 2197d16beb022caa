"""Hugging Face transformers' DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) through sparse-mla.

:func:`enable` replaces the forward of every ``DeepseekV32Attention`` (its indexer included)
with the library's decode step (:class:`sparse_mla.decode.DecodePlan`):

* the indexer's query and key come from the layer's own modules (``wq_b``, ``wk``, ``k_norm``,
  NeoX-style RoPE on their first 64 dims) and are scored by ``index_logits`` over our paged
  indexer K cache; ``select_topk`` keeps the exact top ``index_topk``;
* MLA is absorbed, as engines run it: ``q_lat = q_nope @ W_UK`` per head (W_UK, W_UV are the
  two halves of ``kv_b_proj``), ``[q_lat | q_pe]`` attends over the 576-dim latents
  ``[kv_a_layernorm(c_kv) | k_pe]`` of the selected slots, and ``W_UV`` maps the 512-dim output
  back to ``v_head_dim`` before ``o_proj``; the main RoPE stays interleaved (HF's own helper);
* prefill goes through the same kernels: a prompt chunk is one step whose every token is a row
  with its own causal top-k; decode steps are rows of one token.

Our paged caches (per layer, bf16 or fp8, one shared block table) replace HF's dense cache:
the HF cache object only counts tokens (one scalar per token and layer), so ``generate``'s
positions and masks work unchanged. HF's dense indexer and attention never run.

Supported: greedy / sampled generation, batches, padded batches (an ``attention_mask`` with
zeros: each request's cache holds only its own tokens, so padding is never selected nor
attended; outputs at padding positions are 0 before ``o_proj``) and beam search (the cache's
``reorder_cache``, which ``generate`` calls after each step, copies every beam's pages from
the beam it continues). Not followed: ``Cache.batch_select_indices`` /
``batch_repeat_interleave`` on a filled cache (a forward whose batch differs from the
cache's raises ValueError); ``record_topk``'s records are not reordered with the beams.

Requirements (checked at :func:`enable`): transformers ``>= 5.24`` (``TRANSFORMERS``
is the tested range; earlier releases pass ``past_key_values=`` and drop the ``cache=``
keyword this module relies on); ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64,
``index_head_dim`` 128 and ``index_topk`` a top-k size the kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...decode.plan import DecodeInputs, DecodePlan, DecodePlanConfig
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

# What the replaced forward reads from each DeepseekV32Attention (a transformers release that
# renames one would otherwise fail at the first forward, not at enable()).
LAYER_PARTS = (
    "layer_idx", "num_heads", "scaling", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank",
    "v_head_dim", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
    "kv_a_layernorm", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk", "indexer.k_norm",
    "indexer.weights_proj", "indexer.n_heads", "indexer.head_dim", "indexer.softmax_scale",
    "indexer.index_topk",
)  # fmt: skip


@dataclass
class _Caches:
    index_k: torch.Tensor
    kv: torch.Tensor


@dataclass
class _Tokens:
    """One forward's tokens per request, read from the attention mask: ``before[b]`` of
    request b's own tokens are cached already; ``real`` (bool ``[B, S]``, CPU) marks the
    forward's tokens that are its own (False: padding), None when every one is."""

    before: list[int]
    real: torch.Tensor | None


@dataclass
class SparseMlaState:
    """What :func:`enable` attaches to the model (``model.sparse_mla``).

    fp8: caches (and indexer queries) in the fp8 formats; attention: the plan's attention
    ("auto": the library's sparse_mla_decode; "torch": the batched PyTorch path);
    block_size: tokens per page;
    prefill_chunk: prompt tokens per request and step; record_topk: keep each layer's last
    selected positions of every forward in ``topk[layer_idx]`` (a list of int32
    ``[B, S, index_topk]``, request-local positions (padding not counted) ascending, -1
    padded; all -1 at padding tokens) -- top-k and the remap then run as two launches;
    stage_times: when a dict, each step adds its per-stage wall times to it.
    """

    fp8: bool = False
    attention: str = "auto"
    block_size: int = 64
    prefill_chunk: int = 256
    record_topk: bool = False
    stage_times: dict[str, float] | None = None
    topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    caches: dict[int, _Caches] = field(default_factory=dict)
    pool: PagePool = field(default_factory=PagePool)
    plan: DecodePlan | None = None
    _mask_memo: tuple | None = field(default=None, repr=False)

    @property
    def pages(self) -> list[list[int]]:
        """Each request's page ids (one block table row each)."""
        return self.pool.pages

    def reset(self, batch: int) -> None:
        """Forget every sequence (a new batch of ``batch`` requests); caches are kept."""
        self.pool.reset(batch)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Request ``i`` continues request ``beam_idx[i]`` (beam search): copy that request's
        pages of every layer's caches into request ``i``'s. Every request holds the same
        number of pages, so the block table stays as it is."""
        src = beam_sources(beam_idx, len(self.pages))
        if src is not None:
            caches = [t for c in self.caches.values() for t in (c.kv, c.index_k)]
            self.pool.copy_requests(src, caches)

    def _start(self, layer: int, batch: int, past: int) -> None:
        """A new batch starts at the first layer's forward with an empty HF cache."""
        if past == 0 and (layer == 0 or len(self.pages) != batch):
            self.reset(batch)
        elif len(self.pages) != batch:
            raise ValueError(
                f"this forward has {batch} rows but the paged caches hold {len(self.pages)} "
                "requests: only Cache.reorder_cache is followed (batch_select_indices / "
                "batch_repeat_interleave on a filled cache are not supported)"
            )

    def _tokens(self, mask: torch.Tensor | None, batch: int, past: int, seq: int) -> _Tokens:
        """:func:`_read_mask` once per forward: every layer gets the same mask object."""
        key = (batch, past, seq)
        memo = self._mask_memo
        if memo is not None and memo[0] is mask and memo[1] == key:
            return memo[2]
        tokens = _read_mask(mask, batch, past, seq)
        self._mask_memo = (mask, key, tokens)  # holds the mask: its id cannot be reused
        return tokens

    def _allocate(self, length: int) -> None:
        """Give every request pages for ``length`` tokens."""
        self.pool.grow(-(-length // self.block_size))

    def _layer_caches(self, layer: int, device: torch.device) -> _Caches:
        """The layer's caches, grown (contents copied) to hold every allocated page."""
        held, c, page, fp8 = self.pool.held(), self.caches.get(layer), self.block_size, self.fp8
        self.caches[layer] = c = _Caches(
            grown_cache(c and c.index_k, held,
                        lambda n: new_indexer_k_cache(n, page, fp8=fp8, device=device)),
            grown_cache(c and c.kv, held, lambda n: new_mla_cache(n, page, fp8=fp8, device=device)),
        )  # fmt: skip
        return c

    def _remap(self) -> str:
        """Slots from top-k's epilogue, or (recording) positions remapped by the attention."""
        if not self.record_topk:
            return "topk"
        return "attention" if self.attention == "auto" else "separate"

    def _plan_for(self, attn, rows: int, batch: int, width: int, n: int) -> DecodePlan:
        p = self.plan
        if (
            p is None
            or p.config.max_num_tokens < rows
            or p.config.max_num_requests < batch
            or p.config.max_blocks_per_req < width
            or p.config.max_decode_len < n
            or p.config.remap != self._remap()
        ):
            old = p.config if p is not None else None
            cfg = DecodePlanConfig(
                max_num_tokens=max(rows, old.max_num_tokens if old else 0),
                max_num_requests=max(batch, old.max_num_requests if old else 0),
                max_blocks_per_req=max(width, 2 * old.max_blocks_per_req if old else 0),
                num_heads=attn.num_heads,
                topk=attn.indexer.index_topk,
                max_decode_len=max(n, old.max_decode_len if old else 1),
                block_size=self.block_size,
                remap=self._remap(),
                mla_fp8=self.fp8,
                attention=self.attention,
            )
            device = attn.q_b_proj.weight.device
            self.plan = p = DecodePlan(cfg, sm_scale=attn.scaling, device=device)
        return p


def check_config(config) -> None:
    """Raise ValueError when the model's attention sizes are ones the kernels do not take."""
    want = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
    for name, value in want.items():
        got = getattr(config, name, None)
        if got != value:
            raise ValueError(
                f"sparse-mla needs config.{name} == {value} (the kernels' latent / indexer "
                f"layout), got {got}"
            )
    if not supported_k(config.index_topk):
        raise ValueError(
            f"sparse-mla needs config.index_topk to be an int in [1, {MAX_K}], "
            f"got {config.index_topk!r}"
        )
    if config.q_lora_rank is None:
        raise ValueError("sparse-mla needs config.q_lora_rank (the indexer reads q_lora)")


def check_features() -> None:
    """Raise RuntimeError unless the installed transformers' DeepseekV32 takes ``cache=`` and
    exposes the helpers used here (the version itself: ``_common.check_version``)."""
    m = import_modeling("deepseek_v32", "DeepseekV32")
    takes_cache = {
        "DeepseekV32Attention.forward(cache=)": m.DeepseekV32Attention.forward,
        "DeepseekV32Model.forward(cache=)": m.DeepseekV32Model.forward,
    }
    helpers = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
    missing = missing_cache_keyword(takes_cache)
    raise_missing_features("DeepseekV32", missing + [h for h in helpers if not hasattr(m, h)])


def _check_options(
    fp8: object, attention: object, block_size: object, prefill_chunk: object, record_topk: object
) -> None:
    for name, flag in (("fp8", fp8), ("record_topk", record_topk)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if attention not in ("auto", "torch"):
        raise ValueError(f"attention must be 'auto' or 'torch', got {attention!r}")
    check_common_options(block_size, prefill_chunk)


def enable(
    model: torch.nn.Module,
    *,
    fp8: bool = False,
    attention: str = "auto",
    block_size: int = 64,
    prefill_chunk: int = 256,
    record_topk: bool = False,
) -> torch.nn.Module:
    """Route every ``DeepseekV32Attention`` of ``model`` through sparse-mla; returns ``model``.

    Args:
        model: a ``DeepseekV32ForCausalLM`` / ``DeepseekV32Model`` (any dtype, any device
            the kernels run on). Weights may change later (absorption reads them each step).
        fp8: fp8 caches (FlashMLA's 656-byte latents, DeepGEMM's indexer keys) and fp8
            indexer queries; default bf16 caches.
        attention: "auto" (the library's sparse MLA decode op) or "torch" (the step's batched
            PyTorch attention; everything else still runs the library's kernels).
        block_size: tokens per cache page, an int in ``[1, 2**20]``.
        prefill_chunk: prompt tokens per request taken by one step (bounds the logits
            buffer), an int in ``[1, 2**20]``.
        record_topk: keep each layer's selected positions (see :class:`SparseMlaState`).

    Raises:
        RuntimeError: the installed transformers is not one this module was written for
            (``hf.check_transformers``), or its attention layers lack a part the
            replaced forward reads (:data:`LAYER_PARTS`).
        TypeError: ``model`` is not a DeepSeek-V3.2 (DSA) model; an option has the wrong
            type.
        ValueError: an option is out of range; the config has latent sizes the kernels do
            not take (see module notes).
    """
    check_version(stacklevel=4)
    check_features()
    m = import_modeling("deepseek_v32", "DeepseekV32")

    check_layer_parts(attention_layers(model, m.DeepseekV32Attention)[0], LAYER_PARTS)
    _check_options(fp8, attention, block_size, prefill_chunk, record_topk)
    check_config(model.config)
    state = SparseMlaState(
        fp8=fp8,
        attention=attention,
        block_size=block_size,
        prefill_chunk=prefill_chunk,
        record_topk=record_topk,
    )
    patch_forwards(model, m.DeepseekV32Attention, _make_forward(state, m))
    model.sparse_mla = state
    return model


def _read_mask(mask: torch.Tensor | None, batch: int, past: int, seq: int) -> _Tokens:
    """Which cached and new positions hold each request's own tokens. The last query row of
    HF's 4-D mask ``[B, 1, S, T]`` sees every key up to it, so that row is the padding mask
    (a 2-D ``[B, T]`` mask is one already). One device-to-host copy."""
    total = past + seq
    if mask is None:
        return _Tokens([past] * batch, None)
    if mask.dim() not in (2, 4):
        raise ValueError(
            f"attention_mask must be HF's 4-D [B, 1, S, T] or a 2-D [B, T] mask, got shape "
            f"{tuple(mask.shape)}"
        )
    keys = mask[:, 0, -1] if mask.dim() == 4 else mask
    if keys.shape[-1] < total or keys.shape[0] not in (1, batch):
        raise ValueError(
            f"attention_mask {tuple(mask.shape)} does not cover {batch} requests of {total} tokens"
        )
    keys = keys[:, :total].expand(batch, total)
    if keys.dtype == torch.bool:
        real = keys
    elif mask.dim() == 4 and keys.is_floating_point():
        real = keys == 0  # additive: 0 attends, the dtype's min masks
    else:
        real = keys != 0
    real = real.cpu()
    if bool(real.all()):
        return _Tokens([past] * batch, None)
    return _Tokens(real[:, :past].sum(1).tolist(), real[:, past:].clone())


def _make_forward(state: SparseMlaState, m):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None,
                position_ids=None, **kwargs):  # fmt: skip
        del position_ids, kwargs  # positions via cos/sin; request-local ones via the mask
        batch, seq, _ = hidden_states.shape
        if cache is not None:
            follow_reorders(cache, state)
        past = count_tokens(cache, self.layer_idx, hidden_states)
        tokens = state._tokens(attention_mask, batch, past, seq)
        state._start(self.layer_idx, batch, past)
        x = _project(self, hidden_states, position_embeddings, m, state.fp8)
        # padding tokens get no rows: their outputs stay 0 (and their records -1)
        out = torch.zeros(batch, seq, self.num_heads, 512, dtype=torch.float32,
                          device=hidden_states.device)  # fmt: skip
        if state.record_topk:
            k = self.indexer.index_topk
            state.topk.setdefault(self.layer_idx, []).append(
                torch.full((batch, seq, k), -1, dtype=torch.int32, device=out.device)
            )
        for s0 in range(0, seq, state.prefill_chunk):
            _step(self, state, x, tokens, s0, min(seq, s0 + state.prefill_chunk), out)
        w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, 512)[:, self.qk_nope_head_dim :]
        o = torch.einsum("bshc,hvc->bshv", out, w_uv.float())
        o = o.reshape(batch, seq, -1).to(hidden_states.dtype)
        return self.o_proj(o), None

    return forward


def _project(attn, hidden_states, position_embeddings, m, fp8: bool) -> dict[str, torch.Tensor]:
    """The step's inputs of every token, ``[B, S, ...]``: absorbed MLA query and latent,
    indexer query / weights / key, computed with the layer's own modules."""
    b, s, _ = hidden_states.shape
    h, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    cos, sin = position_embeddings
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q = attn.q_b_proj(q_resid).view(b, s, h, nope + rope).transpose(1, 2)  # [B, H, S, .]
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    ckv = attn.kv_a_proj_with_mqa(hidden_states)
    c_kv, k_rot = torch.split(ckv, [attn.kv_lora_rank, rope], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv)
    q_rot, k_rot = m.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, s, rope), cos, sin)
    w_uk = attn.kv_b_proj.weight.view(h, nope + attn.v_head_dim, 512)[:, :nope]  # [H, nope, 512]
    q_lat = torch.einsum("bhsn,hnc->bshc", q_nope.float(), w_uk.float())
    q576 = torch.cat([q_lat, q_rot.transpose(1, 2).float()], dim=-1).bfloat16()
    kv576 = torch.cat([c_kv, k_rot.view(b, s, rope)], dim=-1).bfloat16()

    ix = attn.indexer
    qi = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    qi_rot, qi_pass = torch.split(qi, [rope, ix.head_dim - rope], dim=-1)
    ki = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    ki_rot, ki_pass = torch.split(ki, [rope, ix.head_dim - rope], dim=-1)
    qi_rot, ki_rot = m.apply_rotary_pos_emb(qi_rot, ki_rot, cos, sin, unsqueeze_dim=2)  # NeoX
    qi = torch.cat([qi_rot, qi_pass], dim=-1)
    ki = torch.cat([ki_rot, ki_pass], dim=-1).squeeze(2)
    w = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float()
    w = w * (ix.n_heads**-0.5 * ix.softmax_scale)  # relu(a * c) = c * relu(a), c > 0
    if fp8:
        qi, w = quantize_index_q(qi.float(), w)
    else:
        qi = qi.bfloat16()
    return {"q": q576, "kv": kv576, "q_idx": qi, "idx_weights": w, "k_idx": ki.bfloat16()}


def _chunk_rows(tokens: _Tokens, b: int, s0: int, s1: int):
    """Tokens ``[s0, s1)`` of each request as the step's rows: ``n_b`` rows of request b
    (its own tokens only), each request's length before them, and the rows' ``(request,
    column)`` indices into ``[B, S]`` (None: every token, request-major)."""
    if tokens.real is None:
        return [s1 - s0] * b, [p + s0 for p in tokens.before], None
    real = tokens.real[:, s0:s1]
    starts = tokens.real[:, :s0].sum(1) + torch.tensor(tokens.before)
    rows, cols = real.nonzero(as_tuple=True)  # request-major, as the plan takes rows
    return real.sum(1).tolist(), starts.tolist(), (rows, cols + s0)


def _step(attn, state: SparseMlaState, x: dict, tokens: _Tokens, s0: int, s1: int,
          out: torch.Tensor) -> None:  # fmt: skip
    """Tokens ``[s0, s1)`` of every request as one decode step, written into ``out``
    (fp32 ``[B, S, H, 512]``)."""
    b, dev = x["q"].shape[0], x["q"].device
    n, starts, where = _chunk_rows(tokens, b, s0, s1)
    if not sum(n):  # padding only
        return
    lengths = [st + k for st, k in zip(starts, n, strict=True)]
    state._allocate(max(lengths))
    caches = state._layer_caches(attn.layer_idx, dev)
    bt = torch.tensor(state.pages, dtype=torch.int32)
    page = state.block_size
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(n))
    pos = torch.cat([torch.arange(st, st + k) for st, k in zip(starts, n, strict=True)])
    slots = bt[req, pos // page] * page + pos % page
    plan = state._plan_for(attn, len(pos), b, bt.shape[1], max(n))
    if where is None:
        where = (slice(None), slice(s0, s1))
        pick = {k: v[:, s0:s1].flatten(0, 1) for k, v in x.items()}
    else:
        where = tuple(w.to(dev) for w in where)
        pick = {k: v[where] for k, v in x.items()}
    inputs = DecodeInputs(
        q_idx=pick["q_idx"],
        idx_weights=pick["idx_weights"],
        k_idx=pick["k_idx"],
        q=pick["q"],
        kv=pick["kv"],
        slot_mapping=slots.to(torch.int32).to(dev),
        index_k_cache=caches.index_k,
        kv_cache=caches.kv,
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=dev),
        block_table=bt.to(dev),
    )
    res = plan.run(inputs, n, max_seq_len=max(lengths), stage_times=state.stage_times)
    shape = out[where].shape
    out[where] = res.out.float().view(shape)
    if state.record_topk:
        record = state.topk[attn.layer_idx][-1]
        record[where] = res.positions.view(record[where].shape)


def tiny_config(**overrides):
    """A small random-model ``DeepseekV32Config`` with the real latent / indexer sizes
    (512 + 64 latent, 64 x 128 indexer) and small everything else; ``overrides`` win."""
    from transformers import DeepseekV32Config

    base = {
        "vocab_size": 256,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 64,  # dense MLPs: no discrete expert routing to flip
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "index_topk": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }
    base.update(overrides)
    return DeepseekV32Config(**base)


def random_model(config=None, *, dtype=torch.float32, seed: int = 0, attn_implementation="eager"):
    """A random ``DeepseekV32ForCausalLM`` (eval mode) from ``config`` (default
    :func:`tiny_config`), weights drawn from ``seed``."""
    from transformers import DeepseekV32ForCausalLM

    config = tiny_config() if config is None else config
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(config).to(dtype).eval()
    return model
