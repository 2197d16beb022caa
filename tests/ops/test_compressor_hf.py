"""The compressors against transformers' own modules (``DeepseekV4CSACompressor`` with its
indexer, ``DeepseekV4HCACompressor``) on a tiny random config, step by step through their
cache: every entry they emit, from the reference (float64) and from the kernel (the bf16
entries it writes into a bf16 cache), in fp32 and in bf16."""

from __future__ import annotations

import pytest
import torch

from sparse_mla._runtime import default_device
from sparse_mla.ops.compressor import (
    compressor_decode,
    compressor_rope_table,
    new_compressor_state,
)
from sparse_mla.ops.compressor.naive import compressor_step_reference
from sparse_mla.ops.kv_cache import new_indexer_k_cache
from sparse_mla.testing import compressor_entry_error

M = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
)

DEV = default_device()
STEPS = [5, 3, 1, 4, 2, 4, 4]  # tokens per call: a prompt, then MTP-sized steps
PAGE = 4


def tiny_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=64, head_dim=64, num_attention_heads=2, q_lora_rank=32, index_n_heads=2,
        index_head_dim=32, partial_rotary_factor=16 / 64, num_hidden_layers=2, vocab_size=100,
        o_groups=1, o_lora_rank=16, sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    )  # fmt: skip


class _Cache:
    """What the compressors read of a transformers cache: ``layers[layer_idx]``."""

    def __init__(self, layer) -> None:
        self.layers = [layer]


class _Ours:
    """One compressor of ours beside transformers' module ``mod``: its ring, a bf16 cache,
    the reference's ring and the reference's entries by index."""

    def __init__(self, mod, overlap: bool, dtype, cos_sin) -> None:
        self.mod, self.overlap, self.cos_sin = mod, overlap, cos_sin
        width, self.dim = mod.kv_proj.out_features, mod.kv_norm.weight.shape[0]
        maxn = max(STEPS)
        self.state = new_compressor_state(1, width, compress_rate=mod.compress_rate,
                                          overlap=overlap, max_decode_len=maxn, dtype=dtype,
                                          device=DEV)  # fmt: skip
        self.ref_state = [t.clone().cpu() for t in self.state]
        self.cache = new_indexer_k_cache(16, PAGE, head_dim=self.dim, fp8=False, device=DEV)
        self.table = torch.arange(16, dtype=torch.int32)[None]
        self.ref: dict[int, torch.Tensor] = {}

    def step(self, h: torch.Tensor, end: int) -> None:
        with torch.no_grad():
            kv, gate = self.mod.kv_proj(h), self.mod.gate_proj(h)
        n, rate = h.shape[0], self.mod.compress_rate
        lens = torch.tensor([end], dtype=torch.int32)
        weights = (self.mod.position_bias.detach(), self.mod.kv_norm.weight.detach())
        compressor_decode(
            kv.to(DEV), gate.to(DEV), *self.state, self.cache, lens.to(DEV),
            self.table.to(DEV), *(w.to(DEV) for w in weights), self.cos_sin.to(DEV),
            compress_rate=rate, overlap=self.overlap, max_decode_len=max(STEPS),
            eps=1e-6, decode_len=n,
        )  # fmt: skip
        out = compressor_step_reference(
            kv, gate, *self.ref_state, lens, self.table, *weights, self.cos_sin,
            compress_rate=rate, overlap=self.overlap, max_decode_len=max(STEPS),
            block_size=PAGE, num_pages=16, eps=1e-6, decode_len=n,
        )  # fmt: skip
        for row in range(n):
            if out.entry_index[row] >= 0:
                self.ref[int(out.entry_index[row])] = out.entries[row]

    def entries(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel's bf16 entries as fp32, reference's float64), the first ``count``."""
        assert sorted(self.ref) == list(range(count))
        return self.cache.view(-1, self.dim)[:count].float().cpu(), torch.stack(
            [self.ref[k] for k in range(count)]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_entries_match_transformers(kind, dtype):
    cfg = tiny_config()
    torch.manual_seed(0)
    cls = M.DeepseekV4CSACompressor if kind == "csa" else M.DeepseekV4HCACompressor
    comp = cls(cfg)
    for p in comp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    comp = comp.to(dtype)
    layer = (M.DeepseekV4CSACache if kind == "csa" else M.DeepseekV4HCACache)(cfg)
    total = sum(STEPS)
    h = torch.randn(1, total, cfg.hidden_size, dtype=dtype)
    q_res = torch.randn(1, total, cfg.q_lora_rank, dtype=dtype)
    cos, sin = comp.rotary_emb(h, position_ids=torch.arange(total)[None], layer_type="compress")
    cos_sin = torch.cat([cos[0], sin[0]], -1)  # transformers' table, in the model's dtype
    rot = comp.rotary_emb
    ours = compressor_rope_table(rot.compress_inv_freq, total, dtype=dtype,
                                 attention_scaling=rot.compress_attention_scaling)  # fmt: skip
    assert torch.equal(ours, cos_sin)
    mods = {"compressor": comp} | ({"indexer": comp.indexer} if kind == "csa" else {})
    ours = {name: _Ours(m, kind == "csa", dtype, cos_sin) for name, m in mods.items()}
    start = 0
    for n in STEPS:
        with torch.no_grad():
            comp(h[:, start : start + n], q_res[:, start : start + n],
                 torch.arange(start, start + n)[None], _Cache(layer), 0)  # fmt: skip
        for mine in ours.values():
            mine.step(h[0, start : start + n], start + n)
        start += n
    for name, mine in ours.items():
        hf = layer.compressed_kv[name][0].double()
        assert hf.shape[0] == total // comp.compress_rate
        kernel, ref = mine.entries(hf.shape[0])
        scale = hf.abs().amax(dim=-1, keepdim=True)
        if dtype == torch.float32:  # transformers in fp32: the same math
            assert ((ref - hf).abs() <= 2e-6 * scale).all(), name
            assert compressor_entry_error(kernel, hf, fp8=False) is None, name
        else:  # transformers rounds weights, products, sum, norm and RoPE to bf16
            for what, got in (("reference", ref), ("kernel", kernel.double())):
                err = ((got - hf).abs() / scale).max().item()
                assert err <= 2.0**-6, (name, what, err)
