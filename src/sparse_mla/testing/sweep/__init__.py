"""The random checks behind ``sparse-mla verify``, one module per op family: each draws a
case's inputs from its seed (the kit's generators), runs our kernel and compares it with the
reference. ``run_case`` returns None when the case passes, else what went wrong."""

from __future__ import annotations

import torch

from .attention import check_attention
from .caches import check_kvcache, check_logits
from .compressor import check_compressor
from .draw import Case
from .indices import check_dcp, check_expand, check_remap
from .topk import check_topk


def check_decode_step(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    """The whole decode step (``sparse_mla.decode``) against its PyTorch reference."""
    from ..cases import check_random_step

    return check_random_step(case.seed, dev)


def check_v4_step(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    """One DeepSeek-V4 layer's decode step (``V4DecodePlan``) against its reference."""
    from ..v4_step import check_random_v4_step

    return check_random_v4_step(case.seed, dev)


RUNNERS = {
    "remap": check_remap,
    "dcp": check_dcp,
    "expand": check_expand,
    "topk": check_topk,
    "kvcache": check_kvcache,
    "logits": check_logits,
    "attention": check_attention,
    "decode_step": check_decode_step,
    "compressor": check_compressor,
    "v4_step": check_v4_step,
}


def run_case(case: Case, dev: torch.device) -> str | None:
    """None when the case passes, else what went wrong (a crash is a failure of the case)."""
    g = torch.Generator().manual_seed(case.seed)
    try:
        return RUNNERS[case.kind](case, g, dev)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"


__all__ = ["RUNNERS", "Case", "run_case"]
