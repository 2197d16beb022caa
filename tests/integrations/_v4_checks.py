"""Checks shared by the DeepSeek-V4 HF-integration tests (CPU: test_hf_v4.py, GPU:
test_hf_v4_gpu.py): HF's forward made to attend our CSA selection, the selection's near-tie
rule, the kit's logits tolerance and greedy near-tie rule applied per request.

Why force the selection: with a small index_topk, one entry selected differently at a
near-tie of the indexer's scores (rows apart by bf16 rounding) moves a row's logits far
beyond any rounding budget. So the CSA selection is checked on its own (:func:`selection_ok`:
HF's fp32 indexer picks the same entries, up to near-ties of its scores, :data:`SCORE_TIE`),
and the logits are compared with HF's forwards whose indexers return our selection
(:func:`hf_forward`): everything else must then agree within the kit's budget.
"""

from __future__ import annotations

import torch

from sparse_mla.testing.generation import FLIP_GAP, first_difference, generation_logits_error

SCORE_TIE = 0.02  # of a row's largest |indexer score|: entries this close may swap


def csa_indexers(model) -> dict[int, torch.nn.Module]:
    return {i: layer.self_attn.compressor.indexer for i, layer in enumerate(model.model.layers)
            if layer.self_attn.layer_type == "compressed_sparse_attention"}  # fmt: skip


def recorded(fast) -> dict[int, torch.Tensor]:
    """Our CSA selection of every position so far, per layer (``[B, positions, k]``)."""
    return {i: torch.cat(calls, dim=1) for i, calls in fast.sparse_mla.topk.items()}


def hf_forward(model, ids, selection: dict[int, torch.Tensor] | None = None):
    """HF's forward on ``ids`` (from position 0): ``(logits, {layer: (its indexer's picks,
    its scores)})``; with ``selection``, each CSA layer attends those entries instead."""
    seen: dict[int, list] = {}
    hooks = []
    for i, ix in csa_indexers(model).items():
        seen[i] = [None, None]
        hooks.append(ix.scorer.register_forward_hook(
            lambda _m, _a, out, i=i: seen[i].__setitem__(1, out)))  # fmt: skip

        def pick(_m, _a, out, i=i):
            seen[i][0] = out
            return None if selection is None else selection[i][:, : out.shape[1]].long()

        hooks.append(ix.register_forward_hook(pick))
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def selection_ok(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, rows: range,
                  rate: int = 4) -> int:  # fmt: skip
    """Rows whose sets equal HF's; a row that differs must differ at a near-tie of HF's
    scores over its visible entries (each entry ours alone within SCORE_TIE of HF's lowest
    pick)."""
    equal = 0
    for r in rows:
        a = set(ours[r][ours[r] >= 0].tolist())
        b = set(theirs[r][theirs[r] >= 0].tolist())
        equal += a == b
        if a != b:
            assert len(a) == len(b), f"row {r}: {sorted(a)} against HF's {sorted(b)}"
            band = SCORE_TIE * scores[r, : (r + 1) // rate].abs().max()
            kth = min(scores[r, e] for e in b)
            for e in a - b:
                assert abs(scores[r, e] - kth) <= band, f"row {r}: entry {e} is no near-tie"
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
