"""The one testing kit: poison values, tolerances and input checks shared by the tests,
``sparse-mla verify``, ``sparse-mla bench`` and the GPU scripts.

Importable by users who want to check their own integration the way we check ours.
"""

from __future__ import annotations

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


def logits_tolerance(
    mag: torch.Tensor, *, heads: int, dim: int, fp8: bool, device: torch.device
) -> torch.Tensor:
    """Absolute tolerance of fp32 indexer logits against the fp64 reference, per element.

    ``mag`` is the reference's magnitude (the same sum over |terms|). fp32 accumulation of
    ``dim`` products per head and ``heads`` weighted terms gives ``(dim + heads + 2) * 2^-24
    * mag``; Hopper's fp8 tensor-core dot accumulates with fewer mantissa bits, ``2^-9 * mag``.
    """
    if fp8 and device.type == "cuda":
        return 2.0**-9 * mag
    return (dim + heads + 2) * 2.0**-24 * mag


def logits_error(
    got: torch.Tensor,
    ref: torch.Tensor,
    mag: torch.Tensor,
    *,
    heads: int,
    dim: int,
    fp8: bool,
    exact: bool = False,
) -> str | None:
    """Why fp32 logits ``got`` differ from the fp64 reference ``ref`` (None when they agree):
    the -inf pattern must match exactly, no NaN or poison, finite values within
    :func:`logits_tolerance` (bit for bit when ``exact``)."""
    device = got.device
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
    tol = logits_tolerance(mag[fin], heads=heads, dim=dim, fp8=fp8, device=device)
    if not torch.all(err <= tol):
        return f"max err/tol {(err / tol.clamp_min(1e-300)).max().item():.3g}"
    return None
