"""HF's own generation against ``hf.enable``'s, timed token by token: the end-to-end section
shared by ``gpu_decode_step.py`` (DeepSeek-V3.2) and ``gpu_v4_hf.py`` (DeepSeek-V4)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed_greedy(m, prompt: torch.Tensor, cfg, chunk: int, steps: int, impl: str):
    """Prefill ``prompt`` in ``chunk``-token forwards (HF's eager masks are O(S x T)), then
    ``steps`` greedy steps timed one by one: (tokens, per-step seconds, per-step logits);
    tokens[i] is the argmax of logits[i], the prefill's token first."""
    from transformers import DynamicCache

    dev = prompt.device
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        for s0 in range(0, prompt.shape[1], chunk):
            logits = m(prompt[:, s0 : s0 + chunk], cache=cache, use_cache=True).logits
        if cache.get_seq_length() != prompt.shape[1]:  # else the decode runs with no history
            raise RuntimeError(
                f"{impl}: the cache holds {cache.get_seq_length()} tokens after a "
                f"{prompt.shape[1]}-token prefill: this transformers ignores cache= "
                "(sparse_mla.integrations.hf.TRANSFORMERS is the supported range)"
            )
        tok = logits[:, -1:].argmax(-1)
        out, times, kept = [int(tok)], [], [logits[0, -1].float().cpu()]
        for _ in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            logits = m(tok, cache=cache, use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            out.append(int(tok))
            kept.append(logits[0, -1].float().cpu())
    return out, times, kept


def hf_against_ours(model, enable: Callable, prompt: torch.Tensor, cfg, chunk: int,
                    steps: int, row: dict) -> dict:  # fmt: skip
    """Fill ``row`` with each side's median ms per token (after the first step), the speedup,
    how many tokens agree, and where the streams part each side's logit gap between the two
    tokens. ``enable`` makes our model from a copy of ``model``."""
    streams, step_logits = {}, {}
    for impl in ("hf", "sparse-mla"):
        m = model if impl == "hf" else enable(copy.deepcopy(model))
        try:
            out, times, kept = timed_greedy(m, prompt, cfg, chunk, steps, impl)
        except torch.OutOfMemoryError as e:
            row[f"{impl} note"] = f"out of memory: {str(e)[:80]}"
            torch.cuda.empty_cache()
            continue
        times = sorted(times[1:]) or times
        row[f"{impl} ms/token"] = 1e3 * times[len(times) // 2]
        streams[impl], step_logits[impl] = out, kept
        del m
        if prompt.device.type == "cuda":
            torch.cuda.empty_cache()
    if len(streams) == 2:
        a, b = streams["hf"], streams["sparse-mla"]
        row["speedup"] = row["hf ms/token"] / row["sparse-mla ms/token"]
        row["same tokens"] = sum(x == y for x, y in zip(a, b, strict=True))
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        row["first difference"] = first
        if first is not None:
            for impl in ("hf", "sparse-mla"):
                lg = step_logits[impl][first]
                row[f"{impl} logit gap"] = float(lg[a[first]] - lg[b[first]])
    return row


def print_rows(rows: list[dict], keys: list[str] | None = None, width: int = 12) -> None:
    """Rows of results as an aligned text table (``keys``: the columns, default every key
    seen, in order; floats to two decimals)."""
    keys = keys or list(dict.fromkeys(k for r in rows for k in r))
    print("  " + " | ".join(f"{k:>{width}}" for k in keys))
    for r in rows:
        cells = [f"{v:{width}.2f}" if isinstance(v, float) else f"{v!s:>{width}}"
                 for v in (r.get(k, "-") for k in keys)]  # fmt: skip
        print("  " + " | ".join(cells))
