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
