"""Random checks of the cache writers (byte-equal to the PyTorch writers, garbage-filled
caches, hostile slots) and the indexer logits (against the fp64 reference within the kit's
tolerance; native, flattened and 2-D lengths)."""

from __future__ import annotations

import torch

from ..._runtime import cdiv
from ...ops.indexer import index_logits, index_logits_reference
from ...ops.kv_cache import new_indexer_k_cache, new_mla_cache, write_indexer_k, write_mla_latent
from ...ops.kv_cache.naive import (
    write_indexer_k_reference,
    write_mla_latent_reference,
    write_model1_latent_reference,
)
from ..checks import POISON, logits_error
from ..inputs import indexer_problem
from .draw import Case, log_uniform_int, rand_choice, rand_int, to_device


def _garbage_like(cache: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The cache filled with random bits: untouched slots must keep them."""
    if cache.dtype == torch.uint8:
        return torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8)
    return torch.randn(cache.shape, generator=g).to(cache.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a (contiguous) cache, for a bitwise comparison."""
    return t.contiguous().view(torch.uint8)


def _rand_rows(g: torch.Generator, tokens: int, dim: int) -> torch.Tensor:
    """bf16 [tokens, dim]: each token at its own magnitude (all-zero and below both fp8
    scale floors included), sometimes as a strided view of a wider tensor. About a quarter of the
    tokens sit on a scale boundary: every 128th value is +-448 * 2**e and the rest are
    smaller, so each quantisation group's amax / 448 is exactly a power of two."""
    scale = torch.tensor([0.0, 1e-7, 1e-3, 1.0, 30.0, 1e4, 1e30])
    mag = scale[torch.randint(0, len(scale), (tokens, 1), generator=g)]
    wide = torch.randn(tokens, dim + 5, generator=g) * mag
    edge = torch.rand(tokens, generator=g) < 0.25
    top = 448.0 * torch.exp2(torch.randint(-12, 13, (tokens, 1), generator=g).float())
    bounded = (torch.rand(tokens, dim + 5, generator=g) * 2 - 1) * top * 0.99
    sign = torch.randint(0, 2, (tokens, 1), generator=g) * 2 - 1
    start = rand_int(g, 0, 5)
    bounded[:, start::128] = top * sign
    wide = torch.where(edge[:, None], bounded, wide).bfloat16()
    return wide[:, start : start + dim]


def check_kvcache(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    cache_kind, page = p["cache"], p["page"]
    fp8 = cache_kind.endswith("fp8")
    tokens = log_uniform_int(g, 1, p["max_tokens"])
    num_pages = cdiv(tokens, page) + rand_int(g, 0, 4)
    num_slots = num_pages * page
    # Distinct slots (two tokens on one slot race), then padding (-1), negative and
    # out-of-range ids, all of which the writers skip.
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots = torch.cat([slots, torch.arange(num_slots, num_slots + tokens)])[:tokens]
    drop = torch.rand(tokens, generator=g) < rand_choice(g, (0.0, 0.1, 0.5, 1.0))
    slots[drop] = -1
    odd = torch.rand(tokens, generator=g) < 0.05
    slots[odd] = torch.tensor([-5, num_slots, num_slots + 10**6])[
        torch.randint(0, 3, (int(odd.sum()),), generator=g)
    ]
    slots = slots.to(rand_choice(g, (torch.int32, torch.int64)))
    if cache_kind.startswith("indexer"):
        dim = rand_choice(g, p["dims"])
        cache = _garbage_like(new_indexer_k_cache(num_pages, page, dim, fp8=fp8, device="cpu"), g)
        k = _rand_rows(g, tokens, dim)
        want = write_indexer_k_reference(k, cache.clone(), slots)
        got = write_indexer_k(k.to(dev), cache.to(dev), slots.to(dev))
    else:
        model1 = cache_kind.startswith("model1")  # DeepSeek-V4's formats: 448 + 64 values
        dim, nope = (512, 448) if model1 else (576, 512)
        fmt = cache_kind.removeprefix("mla_")
        cache = _garbage_like(new_mla_cache(num_pages, page, format=fmt, device="cpu"), g)
        kv = _rand_rows(g, tokens, dim)
        ref = write_model1_latent_reference if model1 else write_mla_latent_reference
        want = ref(kv[:, :nope], kv[:, nope:], cache.clone(), slots)
        got = write_mla_latent(
            kv[:, :nope].to(dev), kv[:, nope:].to(dev), cache.to(dev), slots.to(dev)
        )
    a, b = _bits(got.cpu()), _bits(want)
    if not torch.equal(a, b):
        diff = (a != b).reshape(num_pages * page, -1).any(dim=1).nonzero().flatten().tolist()
        return (
            f"tokens={tokens} dim={dim} slots {slots.dtype}: {len(diff)} cache rows differ, "
            f"first (page, offset) {divmod(diff[0], page)}"
        )
    return None


def check_logits(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    n, fp8, heads, dim, page = p["n"], p["fp8"], p["heads"], p["dim"], p["page"]
    num_req = rand_int(g, 1, p["max_req"])
    width = rand_int(g, 1, p["max_width"])
    integer = rand_int(g, 0, 3) == 0  # every step exact: compared bit for bit
    q, w, cache, lens, bt = indexer_problem(
        g, num_req, n, width * page, heads=heads, dim=dim, block_size=page, fp8=fp8,
        integer=integer, key_scale=10.0 ** rand_int(g, -2, 2), spare_pages=3, hostile=True,
        reference_writer=True,
    )  # fmt: skip
    cap = width * page
    max_len = rand_choice(g, (cap, cap, rand_int(g, 1, cap), cap + 17))

    ref = index_logits_reference(q, w, cache, lens, bt, next_n=n, max_len=max_len)
    mag = index_logits_reference(q, w, cache, lens, bt, next_n=n, max_len=max_len, magnitude=True)
    tol = dict(heads=heads, dim=dim, fp8=fp8, exact=integer, device=dev)
    qd, wd, cd, ld, btd = to_device(dev, q, w, cache, lens, bt)
    rows = num_req * n
    out = torch.full((rows, max_len), float(POISON), device=dev)
    native = index_logits(qd, wd, cd, ld, btd, next_n=n, max_len=max_len, out=out)
    err = logits_error(native.cpu(), ref, mag, **tol)
    if err:
        return f"native B={num_req} W={width} max_len={max_len}: {err}"
    # Flattened: one single-token row per query token, the request's block-table row copied.
    j = torch.arange(n)
    flat_lens = (lens.long()[:, None] - n + 1 + j).clamp(0, 2**31 - 1).flatten().int()
    flat_bt = bt.repeat_interleave(n, dim=0)
    flat = index_logits(qd, wd, cd, flat_lens.to(dev), flat_bt.to(dev), max_len=max_len)
    err = logits_error(flat.cpu(), ref, mag, **tol)
    if err:
        return f"flattened B={num_req} W={width} max_len={max_len}: {err}"
    # The 2-D [B, n] lengths of the native form.
    two_d = index_logits(qd, wd, cd, flat_lens.view(num_req, n).to(dev), btd, max_len=max_len)
    err = logits_error(two_d.cpu(), ref, mag, **tol)
    if err:
        return f"2-D lengths B={num_req} W={width} max_len={max_len}: {err}"
    # Native vs flattened: the same -inf pattern, and within twice the tolerance.
    err = logits_error(native.cpu(), flat.cpu().double(), mag, slack=2, **tol)
    if err:
        return f"native vs flattened B={num_req} W={width}: {err}"
    return None
