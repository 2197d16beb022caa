"""Checks shared by the DeepSeek-V4 HF-integration tests (CPU: test_hf_v4.py, GPU:
test_hf_v4_gpu.py): the CSA selection's near-tie rule, the kit's logits tolerance and greedy
near-tie rule applied per request.

Why force the selection: with a small index_topk, one entry selected differently at a
near-tie of the indexer's scores (rows apart by bf16 rounding) moves a row's logits far
beyond any rounding budget. So the CSA selection is checked on its own (:func:`selection_ok`:
HF's fp32 indexer picks the same entries, up to near-ties of its scores, :data:`SCORE_TIE`),
and the logits are compared with HF's forwards whose indexers return our selection (the
kit's ``v4_forced_forward``): everything else must then agree within the kit's budget.
"""

from __future__ import annotations

import torch

from sparse_mla.testing.generation import FLIP_GAP, first_difference, generation_logits_error

SCORE_TIE = 0.02  # of a row's largest |indexer score|: entries this close may swap


def same_sets(ours: torch.Tensor, theirs: torch.Tensor, r: int) -> bool:
    """Whether row ``r`` of two ``[rows, k]`` selections (-1 padded) holds the same entries."""
    return set(ours[r][ours[r] >= 0].tolist()) == set(theirs[r][theirs[r] >= 0].tolist())


def selection_ok(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, rows: range,
                 rate: int = 4) -> int:  # fmt: skip
    """Rows whose sets equal HF's; a row that differs must differ at a near-tie of HF's
    scores over its visible entries (each entry ours alone within SCORE_TIE of HF's lowest
    pick)."""
    equal = 0
    for r in rows:
        if same_sets(ours, theirs, r):
            equal += 1
            continue
        a = set(ours[r][ours[r] >= 0].tolist())
        b = set(theirs[r][theirs[r] >= 0].tolist())
        assert len(a) == len(b), f"row {r}: {sorted(a)} against HF's {sorted(b)}"
        s = scores[r]
        band = SCORE_TIE * s[: (r + 1) // rate].abs().max()
        gaps = (s[sorted(a - b)] - s[sorted(b)].min()).abs()  # from HF's lowest pick
        assert (gaps <= band).all(), f"row {r}: {sorted(a - b)} no near-tie ({gaps.max():.3g})"
    return equal


def logits_ok(got, low, exact, what: str, scale: float = 1.5, slack: float = 0.05) -> None:
    err, summary = generation_logits_error(got, low, exact, scale=scale, slack=slack)
    print(f"{what} {summary}")
    assert err is None, err


def streams_ok(model, ours: torch.Tensor, theirs: torch.Tensor, prompt: int) -> None:
    """Each request's greedy stream equals HF's up to a first difference at a near-tie."""
    assert ours.shape == theirs.shape
    for r in range(ours.shape[0]):
        diff = first_difference(model, ours[r : r + 1], theirs[r : r + 1], prompt)
        print(f"request {r}: first difference {diff}")
        if diff is not None:
            assert diff[1] <= FLIP_GAP, f"request {r}, token {diff[0]}: HF's gap {diff[1]:.3f}"
