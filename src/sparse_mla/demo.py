"""``sparse-mla demo``: random DeepSeek-V3.2 and DeepSeek-V4 models generating through
sparse-mla, beside Hugging Face's own implementation.

For each model (``--model v32``, ``v4`` or ``both``, the default): builds a random
``DeepseekV32ForCausalLM`` / ``DeepseekV4ForCausalLM`` (transformers), generates greedily
twice from the same prompt -- once with HF's own attention, once with every attention layer
routed through the library's decode step (:mod:`sparse_mla.integrations.hf`) -- prints both
token streams and their agreement, then times one more decode step (V3.2: per stage).

Shapes: ``--shapes tiny`` (the default on the CPU, both models within a minute in the
interpreter) or ``--shapes real`` (the default on a GPU; ``v32`` is its old name):

* V3.2 tiny: 1 layer, 8 heads, the real 512 + 64 latent and 64 x 128 indexer, index_topk 64
  below the context; real: DeepSeek-V3.2's attention dims (128 heads, q_lora 1536, hidden
  7168, index_topk 2048), 4 layers, a 4K prompt.
* V4 tiny: ``hf.v4.tiny_config`` (a sliding, a CSA and an HCA layer, 2 heads, the real
  448 + 64 rows and 128-wide indexer, window 8, index_topk 3); real: V4-Flash's
  attention layers (hidden 4096, 64 heads, window 128, a 64 x 128 indexer keeping 512, rates
  4 and 128), 4 layers (sliding, CSA, HCA, sliding), a 4K prompt.

Exit status 1 when a stream disagrees beyond a near-tie (V4: a near-tie of HF's logits, or
of HF's logits once its CSA layers attend the entries ours selected).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from ._runtime import default_device, info
from .decode.plan import STAGES
from .testing.generation import (
    FLIP_GAP,
    first_difference,
    v4_forced_forward,
    v4_recorded_selection,
)

DEFAULTS = {  # (prompt tokens, new tokens) per model and shapes
    ("v32", "tiny"): (72, 12), ("v32", "real"): (4096, 32),
    ("v4", "tiny"): (24, 10), ("v4", "real"): (4096, 32),
}  # fmt: skip


def _config(shapes: str, layers: int | None):
    """The V3.2 config of ``shapes`` ("tiny" or "v32"/"real")."""
    from .integrations.hf import tiny_config

    if shapes == "tiny":  # the interpreter: about 15 s a layer at the default prompt
        return tiny_config(num_hidden_layers=layers or 1, index_topk=64)
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


def _v4_config(shapes: str, layers: int | None):
    from .integrations.hf import v4

    if shapes == "tiny":
        return v4.tiny_config(**({"num_hidden_layers": layers} if layers else {}))
    return v4.flash_layer_config(layers or 4)


def _stream(tokens: torch.Tensor, start: int) -> str:
    return " ".join(str(t) for t in tokens[start:].tolist())


def _generate(model, prompt: torch.Tensor, new: int):
    kw = {"max_new_tokens": new, "do_sample": False, "return_dict_in_generate": True}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, **kw)
    return out, time.perf_counter() - t0


def _one_step_ms(model, out) -> float:
    """Wall time of one more decode step (every layer), from generate's cache."""
    last = out.sequences[:, -1:]
    sync = torch.cuda.synchronize if last.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(last, cache=out.cache, use_cache=True)
    sync()
    return 1e3 * (time.perf_counter() - t0)


def _stage_times(fast, out) -> None:
    """V3.2: stage times of one more decode step (every layer), from generate's cache."""
    state = fast.sparse_mla
    state.stage_times = {}
    with torch.no_grad():
        fast(out.sequences[:, -1:], cache=out.cache, use_cache=True)
    times, state.stage_times = state.stage_times, None
    total = sum(times.values())
    print("one decode step through sparse-mla (wall time, synchronised per stage):")
    print(f"  {'stage':14} {'ms':>10} {'share':>7}")
    for name in STAGES:
        ms = 1e3 * times.get(name, 0.0)
        print(f"  {name:14} {ms:10.2f} {100 * ms / max(1e3 * total, 1e-9):6.1f}%")
    print(f"  {'total':14} {1e3 * total:10.2f}")


def _verdict(model, fast, a, b, prompt_len: int, v4: bool) -> bool:
    """Print where the streams part (HF's ``a``, ours ``b``) and whether it is a near-tie."""
    diff = first_difference(model, b[None], a[None], prompt_len)
    if diff is None:
        return True
    step, gap = diff
    ok = gap <= FLIP_GAP
    print(
        f"first difference at token {step}: HF's own logits there rank our token {gap:.3f} "
        f"below its pick ({'within' if ok else 'BEYOND'} the near-tie bound {FLIP_GAP})"
    )
    if not ok and v4:  # a CSA entry chosen differently at a near-tie of the indexer's scores?
        sel = v4_recorded_selection(fast)
        _, forced = first_difference(
            model, b[None], a[None], prompt_len, lambda ids: v4_forced_forward(model, ids, sel)[0]
        )
        ok = forced <= FLIP_GAP
        why = (
            "within the bound: they part at a near-tie of the indexer's top-k"
            if ok
            else "BEYOND the bound too"
        )
        print(f"  with HF's CSA layers attending the entries ours selected: {forced:.3f} ({why})")
    print("after it the two streams continue from different prefixes")
    return ok


def run_model(name: str, shapes: str, args, device: torch.device) -> bool:
    """Generate with HF and through sparse-mla, print both; True when they agree."""
    from .integrations import hf

    v4 = name == "v4"
    prompt_len, new = DEFAULTS[name, shapes]
    prompt_len, new = args.prompt or prompt_len, args.new or new
    if v4:
        cfg = _v4_config(shapes, args.layers)
        model = hf.v4.random_model(cfg, dtype=torch.bfloat16, seed=args.seed).to(device)
        desc = (
            f"random DeepseekV4ForCausalLM: {cfg.num_hidden_layers} layer(s) "
            f"({', '.join(hf.v4.KINDS[t] for t in cfg.layer_types)}), "
            f"{cfg.num_attention_heads} heads, hidden {cfg.hidden_size}, window "
            f"{cfg.sliding_window}, rates {cfg.compress_rates}, indexer "
            f"{cfg.index_n_heads}x{cfg.index_head_dim}, index_topk {cfg.index_topk}"
        )
    else:
        cfg = _config(shapes, args.layers)
        model = hf.random_model(cfg, dtype=torch.bfloat16, seed=args.seed).to(device)
        desc = (
            f"random DeepseekV32ForCausalLM: {cfg.num_hidden_layers} layer(s), "
            f"{cfg.num_attention_heads} heads, hidden {cfg.hidden_size}, latent "
            f"{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}, indexer {cfg.index_n_heads}x"
            f"{cfg.index_head_dim}, index_topk {cfg.index_topk}"
        )
    model.generation_config.eos_token_id = None
    torch.manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    print(
        f"\n== {desc}; prompt {prompt_len} tokens, {new} new, bf16, "
        f"{'fp8' if args.fp8 else 'bf16'} caches"
    )

    theirs, t_hf = _generate(model, prompt, new)
    options = {"record_topk": True} if v4 else {}
    fast = hf.enable(copy.deepcopy(model), fp8=args.fp8, **options)
    ours, t_ours = _generate(fast, prompt, new)
    a, b = theirs.sequences[0], ours.sequences[0]
    print(f"HF ({t_hf:.1f} s):\n  {_stream(a, prompt_len)}")
    backend = "" if v4 else f"{fast.sparse_mla.plan.attention_backend} attention, "
    print(f"sparse-mla ({backend}{t_ours:.1f} s):\n  {_stream(b, prompt_len)}")
    same = int((a[prompt_len:] == b[prompt_len:]).sum())
    print(f"agreement: {same}/{new} tokens")
    ok = _verdict(model, fast, a, b, prompt_len, v4)
    if v4:
        print(
            f"one more decode step, {cfg.num_hidden_layers} layer(s): sparse-mla "
            f"{_one_step_ms(fast, ours):.1f} ms, HF {_one_step_ms(model, theirs):.1f} ms"
        )
    else:
        _stage_times(fast, ours)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparse-mla demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("both", "v32", "v4"), default="both")
    p.add_argument(
        "--shapes",
        choices=("tiny", "real", "v32"),
        default=None,
        help="tiny (CPU default) or real (GPU default; v32: its old name)",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens")
    p.add_argument("--new", type=int, default=None, help="tokens to generate")
    p.add_argument("--fp8", action="store_true", help="fp8 caches and indexer queries")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = default_device()
    shapes = args.shapes or ("real" if device.type == "cuda" else "tiny")
    shapes = "real" if shapes == "v32" else shapes
    print(f"sparse-mla demo ({info()}); shapes {shapes}, device {device}")
    models = ("v32", "v4") if args.model == "both" else (args.model,)
    results = {m: run_model(m, shapes, args, device) for m in models}
    ok = all(results.values())
    print("\n" + ("PASS" if ok else f"FAIL ({', '.join(m for m, r in results.items() if not r)})"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
