"""Random checks of the sparse MLA decode attention against the fp64 reference."""

from __future__ import annotations

import torch

from ..._runtime import cdiv
from ...ops.remap.naive import convert_req_index_to_global_index_reference
from .draw import Case, compare, rand_choice, rand_int, to_device


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
    cache = random_mla_cache(pages, page, fp8=p["fp8"], g=g, arbitrary_scales=rand_int(g, 0, 1))
    rows = pages * page
    q = torch.randn(tokens, heads, 576, generator=g) * rand_choice(g, (0.3, 1.0, 8.0))
    q = q.bfloat16()
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
            block_h = 64 if heads > 32 else 16 if p["fp8"] or heads <= 16 else 32
            cfg = AttentionConfig(
                block_h=block_h,
                block_n=64,
                num_splits=cfg.num_splits,
                num_warps=8 if block_h == 64 else 4,
                kernel="sm90",
            )
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
    two = sparse_mla_decode(qd, cd, slots.to(dev), sm_scale=0.1352, config=cfg, **dkw)
    fused = sparse_mla_decode(
        qd, cd, pos.to(dev), sm_scale=0.1352, block_table=bt.to(dev), req_id=req.to(dev),
        block_size=page, config=cfg, **dkw,
    )  # fmt: skip
    return compare(f"{label} fused out", fused[0].cpu(), two[0].cpu()) or compare(
        f"{label} fused lse", fused[1].cpu(), two[1].cpu()
    )
