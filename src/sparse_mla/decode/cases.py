"""Random decode steps (inputs + filled caches) for the tests, ``verify`` and the benchmarks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._runtime import canonical_device
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


def quantize_index_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    block_size: int = 64,
    fp8: bool = False,
    pad_rows: int = 0,
    max_blocks: int | None = None,
    spare_pages: int = 3,
    num_pages: int | None = None,
    device: torch.device | str | None = None,
) -> StepCase:
    """A step over requests of total lengths ``seq_lens`` with ``decode_lens`` new tokens each.

    Past tokens (positions ``< L_b - n_b``) are already in both caches; the new ones are in
    the inputs with their slots. Pages are shuffled over the pool (a random block table).
    ``pad_rows`` extra rows with slot -1 stand for CUDA-graph padding (flattened layout).
    The page pool has ``spare_pages`` pages more than needed, or ``num_pages`` in all (to
    match another case's cache shapes).
    """
    dev = canonical_device(device)
    b = len(seq_lens)
    pages_per_req = [-(-max(n, 1) // block_size) for n in seq_lens]
    width = max_blocks if max_blocks is not None else max(pages_per_req, default=1)
    if num_pages is None:
        num_pages = sum(pages_per_req) + spare_pages
    if num_pages < sum(pages_per_req):
        raise ValueError(f"num_pages={num_pages} < the {sum(pages_per_req)} pages needed")
    perm = list(range(num_pages))
    rng.shuffle(perm)
    bt = torch.zeros(b, width, dtype=torch.int32)
    used = 0
    for r, p in enumerate(pages_per_req):
        bt[r, :p] = torch.tensor(perm[used : used + p], dtype=torch.int32)
        used += p
    idx_cache = new_indexer_k_cache(num_pages, block_size, fp8=fp8, device=dev)
    kv_cache = new_mla_cache(num_pages, block_size, fp8=fp8, device=dev)

    def slots_of(r: int, positions: range) -> list[int]:
        return [int(bt[r, p // block_size]) * block_size + p % block_size if p >= 0 else -1
                for p in positions]  # fmt: skip

    past, new = [], []
    for r, (length, n) in enumerate(zip(seq_lens, decode_lens, strict=True)):
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


# Tolerances of the step against its fp32/fp64 reference (see step_error).
OUT_ATOL, OUT_RTOL = 3e-2, 2e-2  # bf16 output (8 mantissa bits) of a convex mix of bf16 values
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4  # fp32 softmax denominator, summation order only
TIE_RTOL = 1e-5  # indexer scores this close (relative to the row's largest) may swap places


def step_error(result, ref, case: StepCase, *, block_size: int = 64) -> tuple[str | None, int]:
    """Why a :class:`~sparse_mla.decode.DecodeStepOutput` disagrees with its
    :class:`~sparse_mla.decode.naive.StepReference` (None when it agrees), and how many rows
    chose a different top-k set on a near-tie (those rows' out / lse are not compared).

    Selection: per row, the attended slots (mapped back to positions) must equal the
    reference's top-k set, except for positions whose reference score lies within
    ``TIE_RTOL`` of the row's k-th best score. Attention: ``OUT_*`` / ``LSE_*`` tolerances,
    the ``-inf`` lse pattern exactly, no NaN.
    """
    from .naive import row_layout

    x = case.inputs
    req, vis = row_layout(x.seq_lens.cpu(), case.decode_lens, case.num_tokens)
    bt = x.block_table.long().cpu()
    got_slots = None if result.indices is None else result.indices.long().cpu()
    ties, compare = 0, []
    for t in range(case.num_tokens):
        want = set(ref.positions[t][ref.positions[t] >= 0].tolist())
        if got_slots is None:  # the attention remapped: the positions are what it attended
            got = set(result.positions[t][result.positions[t] >= 0].long().tolist())
        elif req[t] < 0:
            got = set()
        else:
            slot_pos = {int(bt[req[t], p // block_size]) * block_size + p % block_size: p
                        for p in range(vis[t])}  # fmt: skip
            got = {slot_pos.get(s, -1 - s) for s in got_slots[t].tolist() if s >= 0}
        if result.positions is not None:
            pos = set(result.positions[t][result.positions[t] >= 0].long().tolist())
            if pos != got:
                return f"row {t}: positions and slots disagree", ties
        if len(got) != len(want):
            return f"row {t}: {len(got)} selected, want {len(want)}", ties
        if got != want:
            sc = ref.scores[t, : vis[t]]
            kth = sc[sorted(want, key=lambda p: sc[p].item())[0]].item()
            tol = TIE_RTOL * max(sc.abs().max().item(), 1e-30)
            bad = [p for p in got ^ want if p < 0 or abs(sc[p].item() - kth) > tol]
            if bad:
                return f"row {t}: selection differs at positions {sorted(bad)[:8]}", ties
            ties += 1
            continue
        compare.append(t)
    rows = torch.tensor(compare, dtype=torch.long)
    out, lse = result.out.float().cpu()[rows], result.lse.cpu()[rows]
    r_out, r_lse = ref.out.cpu()[rows], ref.lse.cpu()[rows]
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return "NaN in out or lse", ties
    if not torch.equal(torch.isinf(lse), torch.isinf(r_lse)):
        return "lse -inf pattern differs", ties
    fin = torch.isfinite(r_lse)
    if not torch.allclose(lse[fin], r_lse[fin], atol=LSE_ATOL, rtol=LSE_RTOL):
        return f"lse max err {(lse[fin] - r_lse[fin]).abs().max().item():.3g}", ties
    if not torch.allclose(out, r_out, atol=OUT_ATOL, rtol=OUT_RTOL):
        return f"out max err {(out - r_out).abs().max().item():.3g}", ties
    return None, ties


def check_random_step(
    seed: int, device: torch.device | str | None = None, *, topk: int = 128
) -> str | None:
    """One randomized plan-vs-reference comparison (for ``sparse-mla verify``): 1-3 requests
    of 0-400 tokens (some padding requests), uniform or ragged ``n`` in 1-3, padding rows,
    bf16 or fp8 caches, each remap placement, 4 or 16 heads. None when they agree, else
    the reason with the seed."""
    from .naive import decode_step_reference
    from .plan import DecodePlan, DecodePlanConfig

    rng = random.Random(seed)
    b = rng.randint(1, 3)
    lens = [rng.choice([0, rng.randint(1, 64), rng.randint(100, 400)]) for _ in range(b)]
    n = [rng.randint(1, 3)] * b if rng.random() < 0.5 else [rng.randint(1, 3) for _ in range(b)]
    ragged = len(set(n)) > 1
    pad = rng.randint(0, 2) if ragged else 0
    heads, fp8 = rng.choice([4, 16]), rng.random() < 0.5
    remap = rng.choice(["topk", "attention", "separate"])
    case = random_step(rng, seq_lens=lens, decode_lens=n, num_heads=heads, fp8=fp8,
                       pad_rows=pad, device=device)  # fmt: skip
    cfg = DecodePlanConfig(case.num_tokens, b, case.max_blocks, heads, topk=topk,
                           max_decode_len=3, remap=remap, mla_fp8=fp8)  # fmt: skip
    plan = DecodePlan(cfg, sm_scale=0.135, device=device)
    ref_inputs = clone_inputs(case.inputs)
    got = plan.run(case.inputs, n, num_tokens=case.num_tokens)
    ref = decode_step_reference(**ref_inputs._asdict(), decode_lens=n, topk=topk, sm_scale=0.135)
    if not torch.equal(case.inputs.kv_cache, ref_inputs.kv_cache):
        return f"seed {seed}: MLA cache writes differ"
    if not torch.equal(case.inputs.index_k_cache, ref_inputs.index_k_cache):
        return f"seed {seed}: indexer cache writes differ"
    err, _ = step_error(got, ref, case)
    return None if err is None else f"seed {seed} (lens={lens} n={n} fp8={fp8} {remap}): {err}"
