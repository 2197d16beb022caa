"""``sparse-mla demo``: a random DeepSeek-V3.2 model generating through sparse-mla, beside HF.

Builds a random ``DeepseekV32ForCausalLM`` (transformers), generates greedily twice from the
same prompt -- once with HF's own dense attention, once with every attention layer routed
through the library's decode step (:mod:`sparse_mla.integrations.hf`) -- prints both token
streams and their agreement, then times the stages of one more decode step (metadata, cache
writes, logits, top-k, attention).

Shapes: ``--shapes tiny`` (default on the CPU: 1 layer, 8 heads, the real 512 + 64 latent
and 64 x 128 indexer, index_topk 128 below the context) or ``--shapes v32`` (default on a GPU:
DeepSeek-V3.2's attention dims, 128 heads, q_lora 1536, hidden 7168, index_topk 2048, a few
layers and a 4K prompt). Exit status 1 when the streams disagree beyond a near-tie.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from ._runtime import default_device, info
from .decode.plan import STAGES

FLIP_GAP = 0.25  # a differing greedy token is a near-tie when HF's own gap is below this


def _config(shapes: str, layers: int | None):
    from .integrations.hf import tiny_config

    if shapes == "tiny":
        return tiny_config(num_hidden_layers=layers or 1)  # the interpreter: about 30 s a layer
    return tiny_config(
        num_hidden_layers=layers or 4,
        hidden_size=7168,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_topk=2048,
        vocab_size=4096,
        initializer_range=0.02,
        max_position_embeddings=163840,
    )


def _stream(tokens: torch.Tensor, start: int) -> str:
    return " ".join(str(t) for t in tokens[start:].tolist())


def _generate(model, prompt: torch.Tensor, new: int):
    kw = {"max_new_tokens": new, "do_sample": False, "return_dict_in_generate": True}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, **kw)
    return out, time.perf_counter() - t0


def _time_one_step(fast, out) -> dict[str, float]:
    """Stage times of one more decode step (every layer), from generate's cache."""
    state = fast.sparse_mla
    state.stage_times = {}
    last = out.sequences[:, -1:]
    with torch.no_grad():
        fast(last, cache=out.cache, use_cache=True)
    times, state.stage_times = state.stage_times, None
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparse-mla demo", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", choices=("tiny", "v32"), default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens")
    p.add_argument("--new", type=int, default=None, help="tokens to generate")
    p.add_argument("--fp8", action="store_true", help="fp8 caches and indexer queries")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from .integrations import hf

    device = default_device()
    shapes = args.shapes or ("v32" if device.type == "cuda" else "tiny")
    prompt_len = args.prompt or (136 if shapes == "tiny" else 4096)
    new = args.new or (24 if shapes == "tiny" else 32)
    print(f"sparse-mla demo ({info()}); shapes {shapes}, device {device}")
    cfg = _config(shapes, args.layers)
    model = hf.random_model(cfg, dtype=torch.bfloat16, seed=args.seed).to(device)
    model.generation_config.eos_token_id = None
    torch.manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    print(
        f"random DeepseekV32ForCausalLM: {cfg.num_hidden_layers} layer(s), "
        f"{cfg.num_attention_heads} heads, hidden {cfg.hidden_size}, latent "
        f"{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}, indexer {cfg.index_n_heads}x"
        f"{cfg.index_head_dim}, index_topk {cfg.index_topk}; prompt {prompt_len} tokens, "
        f"{new} new, bf16, {'fp8' if args.fp8 else 'bf16'} caches"
    )

    theirs, t_hf = _generate(model, prompt, new)
    fast = hf.enable(copy.deepcopy(model), fp8=args.fp8)
    ours, t_ours = _generate(fast, prompt, new)
    a, b = theirs.sequences[0], ours.sequences[0]
    print(f"\nHF (dense attention, {t_hf:.1f} s):\n  {_stream(a, prompt_len)}")
    print(f"sparse-mla ({fast.sparse_mla.plan.attention_backend} attention, {t_ours:.1f} s):")
    print(f"  {_stream(b, prompt_len)}")
    same = int((a[prompt_len:] == b[prompt_len:]).sum())
    print(f"agreement: {same}/{new} tokens")
    ok = True
    if same != new:
        step = int((a != b).nonzero()[0])
        with torch.no_grad():
            logits = model(b[None, :step], use_cache=False).logits[0, -1].float()
        gap = (logits.max() - logits[b[step]]).item()
        ok = gap <= FLIP_GAP
        verdict = "within" if ok else "BEYOND"
        print(f"first difference at token {step - prompt_len}: HF's own logits there rank our "
              f"token {gap:.3f} below its pick ({verdict} the near-tie bound {FLIP_GAP}); after "
              "it the two streams continue from different prefixes")  # fmt: skip

    times = _time_one_step(fast, ours)
    total = sum(times.values())
    print(f"\none decode step through sparse-mla, {cfg.num_hidden_layers} layer(s) "
          f"(wall time, synchronised per stage):")  # fmt: skip
    print(f"  {'stage':14} {'ms':>10} {'share':>7}")
    for name in STAGES:
        ms = 1e3 * times.get(name, 0.0)
        print(f"  {name:14} {ms:10.2f} {100 * ms / max(1e3 * total, 1e-9):6.1f}%")
    print(f"  {'total':14} {1e3 * total:10.2f}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
