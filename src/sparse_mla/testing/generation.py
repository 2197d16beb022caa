"""Checks of a whole model generating through sparse-mla against Hugging Face's own (the HF
integrations' tests, GPU tests and ``sparse-mla demo``): the near-tie rule for greedy streams
and the teacher-forced logits tolerance.

Neither side is exact: the kernels take bf16 rows and run their softmax in fp32, a bf16 HF
model rounds at every op. So logits are measured against an fp32 forward of the same weights
on the same tokens (:func:`generation_logits_error`), and two greedy streams may part only
where HF's own logits nearly tie (:func:`first_difference`, :data:`FLIP_GAP`).

DeepSeek-V4's CSA layers select a few compressed entries (top-k of the indexer's scores): one
entry taken differently at a near-tie of those scores moves a row's logits beyond any
rounding budget when the top-k is small. :func:`v4_forced_forward` runs HF's V4 with its
indexers returning a given selection (ours, recorded by ``enable(record_topk=True)``), so the
rest of the model is compared alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

FLIP_GAP = 0.25  # a differing greedy token is a near-tie when HF's own gap is below this


def first_difference(
    model: torch.nn.Module, ours: torch.Tensor, theirs: torch.Tensor, prompt_len: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[int, float] | None:  # fmt: skip
    """Where two greedy streams ``[1, L]`` from the same prompt part: ``(step, gap)``, the
    first generated token that differs and how far below its own pick HF's ``model`` ranks
    our token there (a teacher-forced forward on our prefix, or ``logits_of(prefix)``'s
    ``[1, S, vocab]``; a near-tie when ``gap <=`` :data:`FLIP_GAP`). None when the streams
    are equal."""
    if torch.equal(ours, theirs):
        return None
    at = int((ours[0] != theirs[0]).nonzero()[0])
    with torch.no_grad():
        out = model(ours[:, :at], use_cache=False).logits if logits_of is None else None
        logits = (logits_of(ours[:, :at]) if out is None else out)[0, -1].float()
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


def v4_csa_indexers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The indexer of each CSA layer of a transformers ``DeepseekV4ForCausalLM``, by layer."""
    return {
        i: layer.self_attn.compressor.indexer
        for i, layer in enumerate(model.model.layers)
        if layer.self_attn.layer_type == "compressed_sparse_attention"
    }


def v4_recorded_selection(fast: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Our CSA selection of every position so far (``enable(record_topk=True)``), per layer:
    int32 ``[B, positions, k]`` (request-local entries, -1 padded)."""
    return {i: torch.cat(calls, dim=1) for i, calls in fast.sparse_mla.topk.items()}


def v4_forced_forward(
    model: torch.nn.Module, ids: torch.Tensor,
    selection: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:  # fmt: skip
    """HF's own V4 forward on ``ids`` (from position 0, no cache): ``(fp32 logits, {layer:
    [its indexer's picks, its scores]})``; with ``selection`` (:func:`v4_recorded_selection`),
    each CSA layer attends those entries instead of its indexer's picks."""
    seen: dict[int, list] = {}
    hooks = []
    for i, ix in v4_csa_indexers(model).items():
        seen[i] = [None, None]

        def scores(_m, _a, out, i=i):
            seen[i][1] = out

        def pick(_m, _a, out, i=i):
            seen[i][0] = out
            return None if selection is None else selection[i][:, : out.shape[1]].long()

        hooks += [ix.scorer.register_forward_hook(scores), ix.register_forward_hook(pick)]
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, seen
