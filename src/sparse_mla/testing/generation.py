"""Checks of a whole model generating through sparse-mla against Hugging Face's own (the HF
integrations' tests, GPU tests and ``sparse-mla demo``): the near-tie rule for greedy streams
and the teacher-forced logits tolerance.

Neither side is exact: the kernels take bf16 rows and run their softmax in fp32, a bf16 HF
model rounds at every op. So logits are measured against an fp32 forward of the same weights
on the same tokens (:func:`generation_logits_error`), and two greedy streams may part only
where HF's own logits nearly tie (:func:`first_difference`, :data:`FLIP_GAP`).
"""

from __future__ import annotations

import copy

import torch

FLIP_GAP = 0.25  # a differing greedy token is a near-tie when HF's own gap is below this


def first_difference(
    model: torch.nn.Module, ours: torch.Tensor, theirs: torch.Tensor, prompt_len: int
) -> tuple[int, float] | None:
    """Where two greedy streams ``[1, L]`` from the same prompt part: ``(step, gap)``, the
    first generated token that differs and how far below its own pick HF's ``model`` ranks
    our token there (a teacher-forced forward on our prefix; a near-tie when ``gap <=``
    :data:`FLIP_GAP`). None when the streams are equal."""
    if torch.equal(ours, theirs):
        return None
    at = int((ours[0] != theirs[0]).nonzero()[0])
    with torch.no_grad():
        logits = model(ours[:, :at], use_cache=False).logits[0, -1].float()
    return at - prompt_len, (logits.max() - logits[ours[0, at]]).item()


def fp32_logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Logits of an fp32 copy of ``model`` (HF's own forward) on ``ids``."""
    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        return ref(ids, use_cache=False, **kwargs).logits.float()


def generation_logits_error(
    got: torch.Tensor, low: torch.Tensor, exact: torch.Tensor, *, scale: float = 1.5,
    slack: float = 0.05,
) -> tuple[str | None, str]:  # fmt: skip
    """``(error, summary)``: ours (``got``) must be within ``scale x`` HF's low-precision
    error (``low``, e.g. its bf16 forward) ``+ slack`` of the fp32 logits ``exact``, in the
    largest and (``slack / 10``) in the mean absolute error; error is None when it is."""
    ours, theirs = (got.float() - exact).abs(), (low.float() - exact).abs()
    summary = (
        f"logits vs fp32: ours max {ours.max():.4f} mean {ours.mean():.5f}, HF low-precision "
        f"max {theirs.max():.4f} mean {theirs.mean():.5f}; max |logit| {exact.abs().max():.2f}"
    )
    if ours.max() > scale * theirs.max() + slack:
        return f"largest error beyond {scale} x HF's + {slack}: {summary}", summary
    if ours.mean() > scale * theirs.mean() + slack / 10:
        return f"mean error beyond {scale} x HF's + {slack / 10}: {summary}", summary
    return None, summary
