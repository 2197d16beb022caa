"""Random checks of the sparse MLA decode attention against the fp64 reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..._runtime import cdiv
from ...ops.remap.naive import convert_req_index_to_global_index_reference
from .draw import Case, compare, rand_choice, rand_int, to_device

if TYPE_CHECKING:
    from ...ops.attention import AttentionConfig


def forced_sm90_config(
    h_q: int, cache_format: str, splits: int, ring_slots: int = 2
) -> AttentionConfig:
    """An ``AttentionConfig`` forcing the Gluon sm_90 kernel at ``h_q`` heads with ``splits``
    splits and a ring of ``ring_slots``: 64 heads a program (kernel B, 8 warps) above 32,
    else 16 (32 on a bf16 cache above 16 heads), as ``decode_sm90.SHAPES`` allows (a
    one-slot ring: bf16 only)."""
    from ...ops.attention import AttentionConfig

    block_h = 64 if h_q > 32 else 16 if h_q <= 16 or cache_format == "fp8" else 32
    return AttentionConfig(block_h=block_h, block_n=64, num_splits=splits, num_stages=ring_slots,
                           num_warps=8 if block_h == 64 else 4, kernel="sm90")  # fmt: skip


def check_attention(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    """Random T, topk, page size, invalid entries, hostile slots, valid counts, sink, fused
    remap and forced splits against the fp64 reference (sparse_mla.testing's tolerance);
    the fused call must equal remap-then-attend bit for bit. Where the Hopper Gluon kernel
    runs, half the forced launch shapes force it instead."""
    from ...ops.attention import AttentionConfig, sparse_mla_decode, sparse_mla_decode_reference
    from ...ops.attention.api import sm90_available  # (not exported by the package)
    from ..checks import attention_error
    from ..inputs import random_attention_indices, random_mla_cache

    p = case.params
    quick, heads = p["quick"], p["heads"]
    page = rand_choice(g, (16, 64))
    pages = rand_int(g, 2, 6) if quick else rand_int(g, 16, 64)
    tokens = rand_int(g, 1, 3 if quick else 48)
    topk = rand_choice(g, (64, 100, 128) if quick else (512, 1000, 2048))
    model1 = p.get("model1", False)  # DeepSeek-V4's rows: 512 wide, K = V
    if model1:
        cache = _model1_cache(pages, page, p["fp8"], g)
    else:
        cache = random_mla_cache(pages, page, fp8=p["fp8"], g=g,
                                 arbitrary_scales=rand_int(g, 0, 1))  # fmt: skip
    rows = pages * page
    q = torch.randn(tokens, heads, 512 if model1 else 576, generator=g)
    q = (q * rand_choice(g, (0.3, 1.0, 8.0))).bfloat16()
    idx = random_attention_indices(
        g, tokens, topk, rows, invalid_tail=rand_int(g, 0, topk // 4),
        invalid_frac=rand_choice(g, (0.0, 0.1, 0.9)),
    )  # fmt: skip
    hostile = torch.rand(tokens, topk, generator=g) < 0.05
    idx[hostile] = rand_choice(g, (rows, -3, 2**31 - 1))
    kw: dict = {}
    if rand_int(g, 0, 1):
        kw["topk_length"] = torch.randint(-2, topk + 3, (tokens,), generator=g, dtype=torch.int32)
    if rand_int(g, 0, 2) == 0:
        kw["attn_sink"] = torch.randn(heads, generator=g) * 3
    # V4's second set, compressed entries (the quick sweep: with 20 heads, not 16; else 3 in 4)
    if model1 and (heads == 20 if quick else rand_int(g, 0, 3) > 0):
        kw.update(_second_set(g, tokens, p["fp8"]))
    cfg = None
    if rand_int(g, 0, 1):
        cfg = AttentionConfig(
            block_h=min(64, max(16, 1 << (heads - 1).bit_length())),
            block_n=rand_choice(g, (16, 32, 64)),
            num_splits=rand_int(g, 1, 8),
            num_warps=rand_choice(g, (4, 8)),
            combine_heads=rand_choice(g, (1, 4, 8)),
            num_stages=rand_int(g, 1, 2),
        )
        if cfg.num_warps == 8 and sm90_available(dev):  # (no extra draw)
            cfg = forced_sm90_config(heads, "fp8" if p["fp8"] else "bf16", cfg.num_splits)
    ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=0.1352, magnitude=True, **kw)
    dkw = {k: v.to(dev) for k, v in kw.items()}
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((tokens, heads), float("nan"), device=dev)
    qd, cd, idd = to_device(dev, q, cache, idx)
    sparse_mla_decode(qd, cd, idd, sm_scale=0.1352, out=out, lse=lse, config=cfg, **dkw)
    label = f"T={tokens} topk={topk} page={page} cfg={cfg} {sorted(kw)}"
    err = attention_error(out, lse, *ref)
    if err:
        return f"{label}: {err}"
    # Fused remap: request-local positions through a hostile block table.
    width, num_req = cdiv(rows, page) + 1, rand_int(g, 1, 3)
    bt = torch.randint(-1, pages + 2, (num_req, width), generator=g, dtype=torch.int32)
    req = torch.randint(-1, num_req + 1, (tokens,), generator=g, dtype=torch.int32)
    pos = torch.randint(-2, width * page + 5, (tokens, topk), generator=g, dtype=torch.int32)
    slots = convert_req_index_to_global_index_reference(req, bt, pos, block_size=page)
    two_kw = fused_kw = dkw
    if "extra_indices" in kw:  # the second set's positions through its own block table
        two_kw, fused_kw = _second_set_fused(g, kw, dkw, req, num_req, dev)
    two = sparse_mla_decode(qd, cd, slots.to(dev), sm_scale=0.1352, config=cfg, **two_kw)
    fused = sparse_mla_decode(
        qd, cd, pos.to(dev), sm_scale=0.1352, block_table=bt.to(dev), req_id=req.to(dev),
        block_size=page, config=cfg, **fused_kw,
    )  # fmt: skip
    return compare(f"{label} fused out", fused[0].cpu(), two[0].cpu()) or compare(
        f"{label} fused lse", fused[1].cpu(), two[1].cpu()
    )


def _model1_cache(pages: int, page: int, fp8: bool, g: torch.Generator) -> torch.Tensor:
    """A MODEL1 cache of random rows (64-value groups of magnitudes 2**-10 .. 2**4)."""
    from ...ops.kv_cache import new_mla_cache
    from ...ops.kv_cache.naive import write_model1_latent_reference

    n = pages * page
    mag = torch.exp2(torch.randint(-10, 5, (n, 8), generator=g).float()).repeat_interleave(64, 1)
    kv = (torch.randn(n, 512, generator=g) * mag).bfloat16()
    cache = new_mla_cache(pages, page, format="model1_fp8" if fp8 else "model1_bf16")
    return write_model1_latent_reference(kv[:, :448], kv[:, 448:], cache, torch.arange(n))


def _second_set(g: torch.Generator, tokens: int, fp8: bool) -> dict:
    """A second index set (DeepSeek-V4's compressed entries) of a MODEL1 call: its own cache
    (another page size), ids with hostile values, maybe valid counts."""
    from ..inputs import random_attention_indices

    page2, pages2 = rand_choice(g, (2, 8, 64)), rand_int(g, 1, 4)
    topk2 = rand_choice(g, (16, 64, 100))
    rows2 = pages2 * page2
    idx2 = random_attention_indices(g, tokens, topk2, rows2,
                                    invalid_frac=rand_choice(g, (0.0, 0.3)))  # fmt: skip
    idx2[torch.rand(tokens, topk2, generator=g) < 0.05] = rand_choice(g, (rows2, -5, 2**31 - 1))
    kw = {"extra_kv_cache": _model1_cache(pages2, page2, fp8, g), "extra_indices": idx2}
    if rand_int(g, 0, 1):
        kw["extra_topk_length"] = torch.randint(-2, topk2 + 3, (tokens,), generator=g,
                                                dtype=torch.int32)  # fmt: skip
    return kw


def _second_set_fused(g, kw, dkw, req, num_req, dev) -> tuple[dict, dict]:
    """The keywords of the second set as global slots and as positions through its own
    hostile block table (the two calls must agree bit for bit)."""
    cache2, topk2 = kw["extra_kv_cache"], kw["extra_indices"].shape[1]
    page2, tokens = cache2.shape[1], req.shape[0]
    width2 = cache2.shape[0] + 1  # one column past the pages
    bt2 = torch.randint(-1, cache2.shape[0] + 2, (num_req + 1, width2), generator=g,
                        dtype=torch.int32)  # fmt: skip
    pos2 = torch.randint(-2, width2 * page2 + 5, (tokens, topk2), generator=g, dtype=torch.int32)
    slots2 = convert_req_index_to_global_index_reference(req, bt2, pos2, block_size=page2)
    return ({**dkw, "extra_indices": slots2.to(dev)},
            {**dkw, "extra_indices": pos2.to(dev), "extra_block_table": bt2.to(dev)})  # fmt: skip
