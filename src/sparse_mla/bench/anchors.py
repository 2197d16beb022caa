"""Other implementations ``sparse-mla bench`` times beside ours, only where the caller names them.

The package looks nothing up on disk: ``--anchors flashmla,vllm,flashinfer,deepgemm`` imports
FlashMLA's ``flash_mla``, ``vllm_triton_sparse_mla`` (vLLM's Triton sparse MLA kernel as one
module), FlashInfer (its top-k) and DeepGEMM's ``deep_gemm`` (its paged indexer logits) by
name, from wherever the user's environment has them (an install or ``PYTHONPATH``); none of
them is a dependency. A caller may also pass an :class:`Anchors` it built itself (the
repository's harness does: ``benchmarks/harness``, with the upstream remap layouts too).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``--anchors`` name -> the module imported for it.
ANCHOR_MODULES: dict[str, str] = {
    "flashmla": "flash_mla",
    "vllm": "vllm_triton_sparse_mla",
    "flashinfer": "flashinfer",
    "deepgemm": "deep_gemm",
}


@dataclass
class Anchors:
    """What the cases time beside ours. ``flashmla``: FlashMLA's ``flash_mla`` module (fp8
    attention); ``vllm``: a module with ``triton_sparse_mla_attention(q, kv, indices,
    sm_scale)`` (bf16 attention); ``flashinfer``: the ``flashinfer`` module (``top_k``,
    ``top_k_ragged_transform``, ``top_k_page_table_transform``: top-k baselines);
    ``deepgemm``: a module with DeepGEMM's ``get_paged_mqa_logits_metadata`` and
    ``fp8_paged_mqa_logits`` (fp8 indexer logits); ``remap_layouts``: name ->
    ``f(K, count_valid=, compact=)`` giving a ``RemapLayout`` (the remap's upstream tilings);
    ``notes``: why one is missing."""

    flashmla: Any = None
    vllm: Any = None
    flashinfer: Any = None
    deepgemm: Any = None
    remap_layouts: dict[str, Callable[..., Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def import_module_or_why(module: str) -> tuple[Any, str | None]:
    """``(module, None)``, or ``(None, why it did not import)``."""
    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001 - an anchor that does not import is skipped
        return None, f"{module} did not import: {e}"


def import_anchors(names: Sequence[str]) -> Anchors:
    """The named anchors (keys of :data:`ANCHOR_MODULES`) imported by module name; one that
    does not import is left out with a note. Raises KeyError on an unknown name."""
    found = Anchors()
    for name in names:
        mod, why = import_module_or_why(ANCHOR_MODULES[name])
        setattr(found, name, mod)
        if why:
            found.notes.append(f"anchor skipped: {why}")
    return found
