"""Random decode steps (inputs + filled caches) for the tests, ``verify`` and the benchmarks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.kv_cache import new_indexer_k_cache, new_mla_cache, write_indexer_k, write_mla_latent
from ..ops.kv_cache.naive import quantize_pow2_e4m3
from .plan import LATENT_DIM, DecodeInputs

INDEX_HEADS, INDEX_DIM = 64, 128


@dataclass
class StepCase:
    """A step's inputs plus what the plan is told on the host."""

    inputs: DecodeInputs
    decode_lens: list[int]
    num_tokens: int
    max_blocks: int


def quantize_index_q(
    q: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 indexer queries: per-(row, head) power-of-two scales folded into the weights.

    Args:
        q: float ``[T, H, D]``; weights: fp32 ``[T, H]``.
    Returns:
        ``(q_fp8 [T, H, D] float8_e4m3fn, weights * scale fp32 [T, H])``.
    """
    values, scale = quantize_pow2_e4m3(q, q.shape[-1])
    return values, weights * scale.squeeze(-1)


def random_step(
    rng: random.Random,
    *,
    seq_lens: Sequence[int],
    decode_lens: Sequence[int],
    num_heads: int,
    page_size: int = 64,
    fp8: bool = False,
    pad_rows: int = 0,
    max_blocks: int | None = None,
    spare_pages: int = 3,
    device: torch.device | str = "cpu",
) -> StepCase:
    """A step over requests of total lengths ``seq_lens`` with ``decode_lens`` new tokens each.

    Past tokens (positions ``< L_b - n_b``) are already in both caches; the new ones are in
    the inputs with their slots. Pages are shuffled over the pool (a random block table).
    ``pad_rows`` extra rows with slot -1 stand for CUDA-graph padding (flattened layout).
    """
    dev = torch.device(device)
    b = len(seq_lens)
    pages_per_req = [-(-max(n, 1) // page_size) for n in seq_lens]
    width = max_blocks if max_blocks is not None else max(pages_per_req, default=1)
    num_pages = sum(pages_per_req) + spare_pages
    perm = list(range(num_pages))
    rng.shuffle(perm)
    bt = torch.zeros(b, width, dtype=torch.int32)
    used = 0
    for r, p in enumerate(pages_per_req):
        bt[r, :p] = torch.tensor(perm[used : used + p], dtype=torch.int32)
        used += p
    idx_cache = new_indexer_k_cache(num_pages, page_size, fp8=fp8, device=dev)
    kv_cache = new_mla_cache(num_pages, page_size, fp8=fp8, device=dev)

    def slots_of(r: int, positions: range) -> list[int]:
        return [int(bt[r, p // page_size]) * page_size + p % page_size if p >= 0 else -1
                for p in positions]  # fmt: skip

    past, new = [], []
    for r, (length, n) in enumerate(zip(seq_lens, decode_lens)):
        past += slots_of(r, range(max(length - n, 0)))
        new += slots_of(r, range(length - n, length))
    if past:  # fill the history with the library writers (fast, and quantised alike)
        s = torch.tensor(past, dtype=torch.int32, device=dev)
        write_indexer_k(torch.randn(len(past), INDEX_DIM, device=dev).bfloat16(), idx_cache, s)
        kv = torch.randn(len(past), LATENT_DIM, device=dev).bfloat16()
        write_mla_latent(kv[:, :512], kv[:, 512:], kv_cache, s)
    t = sum(decode_lens) + pad_rows
    slot_mapping = torch.tensor(new + [-1] * pad_rows, dtype=torch.int32, device=dev)
    q_idx = torch.randn(t, INDEX_HEADS, INDEX_DIM, device=dev).bfloat16()
    weights = torch.randn(t, INDEX_HEADS, device=dev) * (INDEX_HEADS * INDEX_DIM) ** -0.5
    if fp8:
        q_idx, weights = quantize_index_q(q_idx.float(), weights)
    inputs = DecodeInputs(
        q_idx=q_idx,
        idx_weights=weights,
        k_idx=torch.randn(t, INDEX_DIM, device=dev).bfloat16(),
        q=torch.randn(t, num_heads, LATENT_DIM, device=dev).bfloat16(),
        kv=torch.randn(t, LATENT_DIM, device=dev).bfloat16(),
        slot_mapping=slot_mapping,
        index_k_cache=idx_cache,
        kv_cache=kv_cache,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=dev),
        block_table=bt.to(dev),
    )
    return StepCase(inputs, list(decode_lens), t, width)


def clone_inputs(x: DecodeInputs) -> DecodeInputs:
    """A deep copy (caches included), so a reference can write its own caches."""
    return DecodeInputs(*(t.clone() for t in x))
