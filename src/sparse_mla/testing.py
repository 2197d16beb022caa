"""The one testing kit: poison values, tolerances and input generators shared by the tests,
``sparse-mla verify``, ``sparse-mla bench``, the demo and the GPU scripts.

Importable by users who want to check their own integration the way we check ours.
"""

from __future__ import annotations

import random

import torch

# Written into every output before a kernel runs; an element still holding it afterwards
# was never written. Not a value any of our integer outputs can take (ids are >= -1, counts
# and lengths >= 0).
POISON = -7777


def poison(*tensors: torch.Tensor | None) -> None:
    """Fill each given tensor with :data:`POISON` (NaN for floating-point tensors, which no
    finite-output kernel produces and every comparison notices)."""
    for t in tensors:
        if t is None:
            continue
        t.fill_(float("nan") if t.is_floating_point() else POISON)


def logits_tolerance_scale(heads: int, dim: int, *, fp8: bool, device: torch.device) -> float:
    """Absolute tolerance of fp32 indexer logits against the fp64 reference, in units of the
    reference's magnitude ``sum_h |w_h| (|q_h| . |k|)``.

    fp32 accumulation of ``dim`` products per head and ``heads`` weighted terms (bf16 and fp8
    products are exact in fp32) gives ``(dim + heads + 2) * 2^-24``, the bound for bf16 on the
    GPU too (the H200 demo at V3.2 shapes stays under 0.2% of it); Hopper's fp8 tensor-core
    dot accumulates with fewer mantissa bits, ``2^-9``.
    """
    if fp8 and torch.device(device).type == "cuda":
        return 2.0**-9
    return (dim + heads + 2) * 2.0**-24


def logits_tolerance(
    mag: torch.Tensor, *, heads: int, dim: int, fp8: bool, device: torch.device
) -> torch.Tensor:
    """Per-element tolerance :func:`logits_tolerance_scale` ``* mag``."""
    return logits_tolerance_scale(heads, dim, fp8=fp8, device=device) * mag


def logits_error(
    got: torch.Tensor,
    ref: torch.Tensor,
    mag: torch.Tensor,
    *,
    heads: int,
    dim: int,
    fp8: bool,
    exact: bool = False,
    device: torch.device | None = None,
    slack: float = 1.0,
) -> str | None:
    """Why fp32 logits ``got`` differ from the fp64 reference ``ref`` (None when they agree):
    the -inf pattern must match exactly, no NaN or poison, finite values within ``slack`` x
    :func:`logits_tolerance` for the ``device`` that computed ``got`` (default its own device;
    bit for bit when ``exact``)."""
    device = got.device if device is None else torch.device(device)
    got, ref, mag = got.double().cpu(), ref.double().cpu(), mag.double().cpu()
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if torch.isnan(got).any():
        return f"{int(torch.isnan(got).sum())} NaN"
    if (got == POISON).any():
        return "poison left in the output"
    if not torch.equal(torch.isneginf(got), torch.isneginf(ref)):
        at = tuple((torch.isneginf(got) != torch.isneginf(ref)).nonzero()[0].tolist())
        return f"-inf pattern differs, first at {at}: got {got[at].item()} want {ref[at].item()}"
    fin = torch.isfinite(ref)
    if exact:
        if torch.equal(got[fin], ref[fin]):
            return None
        at = tuple((got != ref).logical_and(fin).nonzero()[0].tolist())
        return f"differs at {at}: got {got[at].item()} want {ref[at].item()}"
    err = (got[fin] - ref[fin]).abs()
    tol = slack * logits_tolerance(mag[fin], heads=heads, dim=dim, fp8=fp8, device=device)
    if not torch.all(err <= tol):
        return f"max err/tol {(err / tol.clamp_min(1e-300)).max().item():.3g}"
    return None


# ---- sparse MLA decode attention -------------------------------------------------------------

# Tolerance of the attention against its fp64 reference (sparse_mla_decode_reference with
# magnitude=True). out: bf16 rounding of the result (half an ulp, 2^-9 relative) plus the
# bf16/fp16 rounding of the probabilities before P @ V (2^-9 relative each, so at most 2^-9 of
# sum_j p_j |v_j|): 2^-7 * out_mag covers both with room. lse: fp32 accumulation of the
# 576-term score dots (MMA accumulators included), 2^-18 of the largest score magnitude,
# plus 4e-6 (FlashMLA's own lse is within 4e-6 of such a reference at V3.2 shapes).
ATTN_OUT_RTOL = 2.0**-7
ATTN_LSE_RTOL = 2.0**-18
ATTN_LSE_ATOL = 4e-6


def attention_error(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    out_mag: torch.Tensor,
    score_mag: torch.Tensor,
) -> str | None:
    """Why (out, lse) differ from the reference (None when they agree): no NaN or poison,
    the ``-inf`` lse pattern (empty rows) exact, out within ``ATTN_OUT_RTOL * out_mag``
    (+1e-30), lse within ``ATTN_LSE_ATOL + ATTN_LSE_RTOL * score_mag``."""
    out, lse = out.double().cpu(), lse.double().cpu()
    ref_out, ref_lse = ref_out.double().cpu(), ref_lse.double().cpu()
    out_mag, score_mag = out_mag.double().cpu(), score_mag.double().cpu()
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return f"shapes {tuple(out.shape)}/{tuple(lse.shape)} != reference's"
    for name, t in (("out", out), ("lse", lse)):
        if torch.isnan(t).any():
            return f"{int(torch.isnan(t).sum())} NaN in {name} (or poison left)"
    err = (out - ref_out).abs()
    tol = ATTN_OUT_RTOL * out_mag + 1e-30
    if not torch.all(err <= tol):
        ratio = err / tol
        at = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
        return (
            f"out: max err {err.max().item():.3g}, max err/tol {ratio.max().item():.3g} at "
            f"{at}: got {out[at].item():.6g} want {ref_out[at].item():.6g}"
        )
    return _score_error("lse", lse, ref_lse, score_mag)


def _score_error(name: str, got: torch.Tensor, ref: torch.Tensor, score_mag: torch.Tensor):
    """A per-(row, head) score statistic (lse, max_logits) against the reference's: the
    ``-inf`` pattern (empty rows) exact, the rest within ``ATTN_LSE_ATOL + ATTN_LSE_RTOL *
    score_mag`` (inputs in float64 on the CPU)."""
    if not torch.equal(torch.isneginf(got), torch.isneginf(ref)):
        at = tuple((torch.isneginf(got) != torch.isneginf(ref)).nonzero()[0].tolist())
        return f"{name} -inf pattern differs at {at}: got {got[at].item()} want {ref[at].item()}"
    fin = torch.isfinite(ref)
    err = (got[fin] - ref[fin]).abs()
    tol = ATTN_LSE_ATOL + ATTN_LSE_RTOL * score_mag[fin]
    if not torch.all(err <= tol):
        return f"{name}: max err {err.max().item():.3g}, max err/tol {(err / tol).max().item():.3g}"
    return None


def max_logits_error(got: torch.Tensor, ref: torch.Tensor, score_mag: torch.Tensor) -> str | None:
    """Why ``max_logits`` differ from the reference's (None when they agree): no NaN or
    poison, then as lse (:func:`attention_error`)."""
    got, ref, score_mag = got.double().cpu(), ref.double().cpu(), score_mag.double().cpu()
    if torch.isnan(got).any():
        return f"{int(torch.isnan(got).sum())} NaN in max_logits (or poison left)"
    return _score_error("max_logits", got, ref, score_mag)


def attention_max_errors(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> tuple[float, float]:
    """(max |out - ref|, max |lse - ref| over finite lse) as floats, for reports."""
    oe = (out.double() - ref_out.double()).abs().max().item() if out.numel() else 0.0
    fin = torch.isfinite(ref_lse)
    le = (lse.double()[fin] - ref_lse.double()[fin]).abs().max().item() if fin.any() else 0.0
    return oe, le


def random_mla_cache(
    num_pages: int,
    block_size: int,
    *,
    fp8: bool,
    g: torch.Generator,
    scale: float = 1.0,
    arbitrary_scales: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An MLA latent cache (``new_mla_cache``'s formats) with every slot holding a random
    latent of magnitude ``scale``, written by the reference writer (fp8: power-of-two scales).
    ``arbitrary_scales`` then multiplies each fp32 scale by a random factor in [0.5, 2)
    (the stored e4m3 values stay, so each row is still an exact e4m3 * scale)."""
    from .ops.kv_cache import new_mla_cache
    from .ops.kv_cache.naive import write_mla_latent_reference

    rows = num_pages * block_size
    kv = (torch.randn(rows, 576, generator=g) * scale).bfloat16().to(device)
    cache = new_mla_cache(num_pages, block_size, fp8=fp8, device=device)
    write_mla_latent_reference(kv[:, :512], kv[:, 512:], cache, torch.arange(rows, device=device))
    if fp8 and arbitrary_scales:
        sc = cache.view(rows, -1)[:, 512:528].view(torch.float32)
        factor = 0.5 + 1.5 * torch.rand(sc.shape, generator=g)
        sc.mul_(factor.to(device))
    return cache


def random_attention_indices(
    g: torch.Generator,
    num_tokens: int,
    topk: int,
    num_rows: int,
    *,
    invalid_tail: int = 0,
    invalid_frac: float = 0.0,
) -> torch.Tensor:
    """int32 ``[T, topk]`` random slots in ``[0, num_rows)``; the last ``invalid_tail`` of a
    row and a random ``invalid_frac`` of the rest are -1."""
    idx = torch.randint(0, max(num_rows, 1), (num_tokens, topk), generator=g, dtype=torch.int32)
    if invalid_frac > 0:
        idx[torch.rand(num_tokens, topk, generator=g) < invalid_frac] = -1
    if invalid_tail > 0:
        idx[:, topk - invalid_tail :] = -1
    return idx


# ---------------------------------------------------------------------------------------
# Decode context parallelism (sparse_mla.dcp): inputs of one simulated rank
# ---------------------------------------------------------------------------------------


def dcp_scores(
    rows: int, n: int, *, kind: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """fp32 ``[rows, n]`` indexer-like scores for DCP top-k tests (CPU).

    ``kind``: ``"normal"`` (distinct with probability ~1), ``"ties"`` (three values, so
    ties straddle every rank), ``"special"`` (ties plus -inf, NaN, -0.0 and +0.0).
    """
    if kind == "normal":
        return torch.randn(rows, n, generator=generator)
    x = torch.randint(0, 3, (rows, n), generator=generator).float()
    if kind == "ties":
        return x
    if kind != "special":
        raise ValueError(f"kind must be 'normal', 'ties' or 'special', got {kind!r}")
    pick = torch.randint(0, 8, (rows, n), generator=generator)
    x = torch.where(pick == 0, float("-inf"), x)
    x = torch.where(pick == 1, float("nan"), x)
    x = torch.where(pick == 2, -0.0, x)
    return torch.where(pick == 3, 0.0, x)


def dcp_shard_scores(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    fill: float = float("nan"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DCP rank's view of full rows: the scores of the positions it owns, in local order.

    Args:
        logits: fp32 ``[T, N]``, scores of global positions.
        seq_lens: int32 ``[T]``, global lengths (clamped to ``[0, N]``).

    Returns:
        ``(local_logits fp32 [T, N_local], local_seq_lens int32 [T])``: column ``l`` is the
        rank's ``l``-th owned position; ``N_local`` is the same on every rank (the most any
        rank owns of N), columns the rank does not have hold ``fill`` (which a correct
        kernel never reads as a candidate).
    """
    from .ops._common.dcp import dcp_local_count_reference, dcp_owner_reference

    rows, n = logits.shape
    pos = torch.arange(n)
    mine = pos[dcp_owner_reference(pos, dcp_size, interleave) == dcp_rank]
    n_local = max(
        int(dcp_local_count_reference(torch.tensor([n]), r, dcp_size, interleave))
        for r in range(dcp_size)
    )
    local = torch.full((rows, n_local), fill, dtype=torch.float32)
    local[:, : mine.numel()] = logits[:, mine]
    lens = seq_lens.clamp(0, n).to(torch.int32)
    local_lens = dcp_local_count_reference(lens, dcp_rank, dcp_size, interleave)
    return local, local_lens.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Input generators
# --------------------------------------------------------------------------------------------


def ragged_lens(total: int, n: int, rng: random.Random) -> list[int]:
    """Decode lengths uniform in [1, n] whose sum is exactly ``total`` (the last one trimmed)."""
    lens: list[int] = []
    left = total
    while left > 0:
        v = min(rng.randint(1, n), left)
        lens.append(v)
        left -= v
    return lens


def distinct_block_table(
    num_pages: int,
    rows: int,
    width: int,
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """int32 ``[rows, width]`` block table of distinct random page ids in ``[0, num_pages)``
    (every request its own pages, scattered over the cache); needs ``rows * width <=
    num_pages``. ``generator`` must live on ``device``."""
    if rows * width > num_pages:
        raise ValueError(f"{rows} x {width} distinct pages need num_pages >= {rows * width}")
    perm = torch.randperm(num_pages, device=device, generator=generator)
    return perm[: rows * width].view(rows, width).to(torch.int32)


def indexer_queries(
    rows: int,
    heads: int,
    dim: int,
    *,
    fp8: bool,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random indexer queries ``[rows, heads, dim]`` (bf16, or e4m3 when ``fp8``) and fp32
    head weights ``[rows, heads]`` scaled by ``(heads * dim)^-1/2`` as V3.2 folds them."""
    q = torch.randn(rows, heads, dim, device=device, generator=generator)
    q = q.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    w = torch.randn(rows, heads, device=device, generator=generator) * (heads * dim) ** -0.5
    return q, w


def filled_indexer_cache(
    num_pages: int,
    block_size: int,
    dim: int,
    *,
    fp8: bool,
    device: torch.device | str | None = None,
    chunk: int = 1 << 20,
) -> torch.Tensor:
    """An indexer K cache of ``num_pages`` pages of standard-normal bf16 keys, written through
    ``write_indexer_k`` (so the fp8 format holds real scales) ``chunk`` tokens at a time to
    bound the temporaries."""
    from . import new_indexer_k_cache, write_indexer_k
    from ._runtime import canonical_device

    device = canonical_device(device)
    cache = new_indexer_k_cache(num_pages, block_size, dim, fp8=fp8, device=device)
    total = num_pages * block_size
    for s0 in range(0, total, chunk):
        t = min(chunk, total - s0)
        keys = torch.randn(t, dim, device=device, dtype=torch.bfloat16)
        write_indexer_k(keys, cache, torch.arange(s0, s0 + t, device=device, dtype=torch.int64))
    return cache


def compiled_matches_eager(fn, make_args, *, backend: str = "aot_eager") -> dict:
    """Check ``torch.compile(fn, fullgraph=True)`` against ``fn`` run eagerly.

    ``make_args()`` gives fresh arguments for each run (copies where ``fn`` writes into
    them); ``fn`` returns a tensor or a sequence of tensors (None allowed). Raises
    AssertionError unless Dynamo made exactly one graph (``fullgraph`` already raises on a
    break), traced no raw Triton launch (every kernel came as a ``torch.ops.sparse_mla`` op),
    logged no "assuming every input is mutated" warning, and every output equals eager's
    bit for bit. ``backend``: what compiles the graph ("aot_eager": functionalisation and
    the fakes without Inductor's code generation; "inductor" on a GPU).

    Returns:
        ``{"graphs", "first_call_s", "ops"}``: graphs made, the compiled first call's wall
        time, the ``sparse_mla`` ops in the graph.
    """
    import logging
    import time

    def listed(result) -> list:
        return [result] if isinstance(result, torch.Tensor) else list(result)

    want = [None if t is None else t.clone() for t in listed(fn(*make_args()))]
    graphs: list = []
    messages: list[str] = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger("torch._dynamo")
    logger.addHandler(handler)  # where triton_kernel_wrap warns about mutations
    torch._dynamo.reset()
    try:
        args = make_args()
        start = time.perf_counter()
        got = listed(torch.compile(fn, fullgraph=True, backend=recorder)(*args))
        first_call_s = time.perf_counter() - start
    finally:
        logger.removeHandler(handler)
    targets = {str(node.target) for g in graphs for node in g.graph.nodes}
    problems = [f"{len(graphs)} graphs"] if len(graphs) != 1 else []
    if any("triton" in t for t in targets):
        problems.append("a raw Triton launch was traced")
    if any("every input is mutated" in m for m in messages):
        problems.append("'assuming every input is mutated' was logged")
    if len(got) != len(want):
        problems.append(f"{len(got)} outputs, eager gave {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if (g is None) != (w is None) or (g is not None and not torch.equal(g, w)):
            problems.append(f"output {i} differs from eager")
    if problems:
        raise AssertionError("; ".join(problems))
    ops = sorted({t.split(".")[1] for t in targets if t.startswith("sparse_mla.")})
    return {"graphs": len(graphs), "first_call_s": round(first_call_s, 2), "ops": ops}
