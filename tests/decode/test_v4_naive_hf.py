"""The V4 layer reference (``decode/v4_naive.py``) against transformers' own
``DeepseekV4Attention`` (sliding, CSA and HCA layers) on a tiny random fp32 config: a prompt in
one HF forward, then decode steps of 1 and 2 tokens, teacher-forced; our reference runs the
same tokens as decode steps (MTP rows) from the projected rows HF computes. Compared: the
attention output before ``o_a_proj`` (inverse RoPE applied), every token.

Tolerance: our caches hold bf16 rows (MODEL1 bf16 window and compressed caches, a bf16
indexer cache), HF's stay fp32, so the outputs (convex combinations of rows of norm ~1 per
dim) differ by bf16 rounding of the keys and values: ``1e-2 * max|out|`` per layer holds with
a margin (observed <= 4e-3); a wrong window edge, entry or sink is ~1e-1."""

from __future__ import annotations

import pytest
import torch

from sparse_mla.decode.v4_naive import V4Compressor, V4StepInputs, v4_decode_step_reference
from sparse_mla.ops.compressor import new_compressor_state
from sparse_mla.ops.kv_cache import new_indexer_k_cache, new_mla_cache

M = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DynamicCache  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
)

KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
         "heavily_compressed_attention": "hca"}  # fmt: skip
STEPS = [21, 1, 2, 1, 1, 2, 1, 2]  # the prompt, then decode steps (1 token or 2 MTP rows)
PAGES, PAGE, WINDOW, TOL = 16, 4, 8, 1e-2


def tiny_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=64, head_dim=512, num_attention_heads=2, q_lora_rank=32, index_n_heads=8,
        index_head_dim=128, partial_rotary_factor=64 / 512, num_hidden_layers=3,
        vocab_size=100, o_groups=1, o_lora_rank=16, sliding_window=WINDOW, index_topk=3,
        layer_types=list(KINDS),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    )  # fmt: skip


def _init(module: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "position_bias" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:  # sinks, position biases
                p.copy_(torch.randn(p.shape, generator=gen))


def _mask(start: int, n: int) -> torch.Tensor:
    """HF's additive sliding-window causal mask over the keys its cache returns (the last
    ``WINDOW - 1`` positions before ``start``, then the ``n`` new ones)."""
    keys = torch.arange(max(start - WINDOW + 1, 0), start + n)
    qpos = torch.arange(start, start + n)[:, None]
    ok = (keys[None] <= qpos) & (qpos - keys[None] < WINDOW)
    return torch.zeros(1, 1, n, keys.numel()).masked_fill(~ok, float("-inf"))


class _Layer:
    """One layer's library-side state: caches, rings, RoPE tables."""

    def __init__(self, attn, kind: str, rope_tables: dict[str, torch.Tensor]) -> None:
        self.attn, self.kind, maxn = attn, kind, max(STEPS)
        self.window = new_mla_cache(PAGES, PAGE, format="model1_bf16", device="cpu")
        self.table = torch.arange(PAGES, dtype=torch.int32)[None]
        self.out_cos_sin = rope_tables["main" if kind == "sliding" else "compress"]
        self.cmp = self.idx = None
        if kind != "sliding":
            self.cmp = self._compressor(attn.compressor, kind == "csa", maxn, rope_tables)
        if kind == "csa":
            self.idx = self._compressor(attn.compressor.indexer, True, maxn, rope_tables)

    @staticmethod
    def _compressor(mod, overlap, maxn, tables) -> V4Compressor:
        width, dim = mod.kv_proj.out_features, mod.kv_norm.weight.shape[0]
        state = new_compressor_state(1, width, compress_rate=mod.compress_rate,
                                     overlap=overlap, max_decode_len=maxn, dtype=torch.float32,
                                     device="cpu")  # fmt: skip
        if dim == 512:
            cache = new_mla_cache(PAGES, PAGE, format="model1_bf16", device="cpu")
        else:
            cache = new_indexer_k_cache(PAGES, PAGE, head_dim=dim, fp8=False, device="cpu")
        return V4Compressor(*state, cache, mod.position_bias.detach(),
                            mod.kv_norm.weight.detach(), tables["compress"])  # fmt: skip

    def step(self, h: torch.Tensor, pe, start: int) -> torch.Tensor:
        """Our reference on HF's projected rows of ``h [1, n, hidden]`` at ``start``."""
        a, n = self.attn, h.shape[1]
        cos, sin = pe["main" if self.kind == "sliding" else "compress"]
        q_res = a.q_a_norm(a.q_a_proj(h))
        q = a.q_b_norm(a.q_b_proj(q_res).view(1, n, -1, 512).transpose(1, 2))
        q = M.apply_rotary_pos_emb(q, cos, sin)[0].transpose(0, 1)
        kv = M.apply_rotary_pos_emb(a.kv_norm(a.kv_proj(h)).view(1, 1, n, 512), cos, sin)[0, 0]
        extra = {}
        if self.kind != "sliding":
            c = a.compressor
            extra = {"cmp_kv": c.kv_proj(h)[0], "cmp_gate": c.gate_proj(h)[0],
                     "compressed_block_table": self.table}  # fmt: skip
        if self.kind == "csa":
            ix = a.compressor.indexer
            qi = ix.q_b_proj(q_res).view(1, n, -1, ix.head_dim).transpose(1, 2)
            qi = M.apply_rotary_pos_emb(qi, *pe["compress"])[0].transpose(0, 1)
            w = ix.scorer.weights_proj(h)[0] * ix.scorer.weights_scaling * ix.scorer.softmax_scale
            extra |= {"idx_kv": ix.kv_proj(h)[0], "idx_gate": ix.gate_proj(h)[0], "q_idx": qi,
                      "idx_weights": w}  # fmt: skip
        x = V4StepInputs(
            q, kv, self.window, self.table, torch.tensor([start + n], dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32), self.out_cos_sin, a.sinks.detach(), **extra,
        )  # fmt: skip
        rate = a.compressor.compress_rate if self.cmp is not None else 1
        res = v4_decode_step_reference(
            x, kind=self.kind, sm_scale=a.scaling, window=WINDOW, compress_rate=rate,
            topk=a.config.index_topk, max_decode_len=max(STEPS), compressor=self.cmp,
            indexer=self.idx,
        )  # fmt: skip
        return res.out


@torch.no_grad()
def test_reference_matches_transformers_attention():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = tiny_config()
    cfg._attn_implementation = "eager"
    rotary = M.DeepseekV4RotaryEmbedding(cfg)
    total = sum(STEPS)
    pos_all = torch.arange(total)[None]
    tables = {t: torch.cat(rotary(torch.zeros(1), pos_all, layer_type=t), -1)[0]
              for t in ("main", "compress")}  # fmt: skip
    cache = DynamicCache(config=cfg)
    layers, captured = [], {}
    for i, lt in enumerate(cfg.layer_types):
        attn = M.DeepseekV4Attention(cfg, i).eval()
        _init(attn, gen)
        attn.o_a_proj.register_forward_pre_hook(lambda _m, args, i=i: captured.update({i: args[0]}))
        layers.append(_Layer(attn, KINDS[lt], tables))
    hidden = torch.randn(1, total, cfg.hidden_size, generator=gen)
    start, worst = 0, {}
    for n in STEPS:
        h, pid = hidden[:, start : start + n], pos_all[:, start : start + n]
        pe = {t: rotary(h, pid, layer_type=t) for t in ("main", "compress")}
        for i, layer in enumerate(layers):
            layer.attn(h, pe, pid, _mask(start, n), cache=cache)
            want = captured[i][0].reshape(n, cfg.num_attention_heads, 512).double()
            got = layer.step(h, pe, start)
            err = ((got - want).abs().max() / want.abs().max()).item()
            worst[layer.kind] = max(worst.get(layer.kind, 0.0), err)
            assert err < TOL, f"{layer.kind} layer, tokens {start}..{start + n - 1}: {err:.2e}"
        start += n
    assert set(worst) == {"sliding", "csa", "hca"}, worst
