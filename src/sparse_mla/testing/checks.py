"""Checks of the testing kit: the poison value, the tolerances of the float kernels, the
compiled-against-eager check and the CUDA allocation count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def cuda_allocations(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result and how many times the CUDA caching allocator allocated while it ran
    (calls, not bytes: a capture or replay that allocates anything shows, whatever it frees)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.memory_stats()["allocation.all.allocated"] - before


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


#: Per-row arguments of ``sparse_mla_decode``: cut to the rows :func:`attention_call_error` checks.
_PER_ROW_ARGS = ("topk_length", "req_id", "extra_indices", "extra_topk_length")


def attention_call_error(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float,
    rows: int | None = None,
    dtype: torch.dtype = torch.float32,
    **call: object,
) -> str | None:
    """Why the ``(out, lse)`` a ``sparse_mla_decode(q, kv_cache, indices, sm_scale=sm_scale,
    **call)`` returned differ from ``sparse_mla_decode_reference`` on the first ``rows`` query
    rows (all when None), or None when they agree (:func:`attention_error`). The reference
    runs in ``dtype`` on the inputs' device (fp32 by default: engine-size problems on a GPU;
    the tolerances hold there too). The GPU tests and the timing scripts share it, the scripts
    to refuse timing a kernel whose output is wrong."""
    from ..ops.attention import sparse_mla_decode_reference

    n = q.shape[0] if rows is None else min(rows, q.shape[0])
    call = {k: v[:n] if k in _PER_ROW_ARGS and v is not None else v for k, v in call.items()}
    ref = sparse_mla_decode_reference(
        q[:n], kv_cache, indices[:n], sm_scale=sm_scale, dtype=dtype, chunk=4, magnitude=True,
        **call,
    )  # fmt: skip
    return attention_error(out[:n], lse[:n], *ref)


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


# ---- DeepSeek-V4 compressors -----------------------------------------------------------------

# Tolerance of a compressed entry (read back from the cache) against the float64 reference.
# bf16: the kernel's fp32 pooling, norm and RoPE, then one rounding to bf16 (half an ulp,
# 2^-9 relative): 2^-8 of the value, plus 2^-14 of the row's largest magnitude for fp32
# cancellation in the gated sum and the rotation. fp8 (values quantised after that rounding):
# e4m3's half ulp, 2^-4 of the value, and 2^-16 of the row's magnitude for its subnormals.
COMPRESSOR_RTOL = 2.0**-8
COMPRESSOR_ROW_ATOL = 2.0**-14
COMPRESSOR_FP8_RTOL = 2.0**-4
COMPRESSOR_FP8_ROW_ATOL = 2.0**-16


def compressor_entry_error(got: torch.Tensor, ref: torch.Tensor, *, fp8: bool) -> str | None:
    """Why compressed entries ``got`` ``[E, D]`` (dequantised from the cache) differ from the
    float64 reference ``ref`` (None when they agree): no NaN, each element within
    ``rtol * |ref| + row_atol * max|ref row|`` (``COMPRESSOR_*``; the fp8 terms added for an
    fp8 cache)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    if got.shape != ref.shape:
        return f"entries: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if torch.isnan(got).any():
        return f"entries: {int(torch.isnan(got).sum())} NaN"
    rtol, atol = COMPRESSOR_RTOL, COMPRESSOR_ROW_ATOL
    if fp8:
        rtol, atol = rtol + COMPRESSOR_FP8_RTOL, atol + COMPRESSOR_FP8_ROW_ATOL
    tol = rtol * ref.abs() + atol * ref.abs().amax(dim=-1, keepdim=True)
    err = (got - ref).abs()
    if not torch.all(err <= tol):
        ratio = err / tol.clamp_min(1e-300)
        at = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
        return (
            f"entries: max err/tol {ratio.max().item():.3g} at {at}: got {got[at].item():.6g} "
            f"want {ref[at].item():.6g}"
        )
    return None
