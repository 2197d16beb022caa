"""The repository's anchors: FlashMLA and vLLM's Triton kernel from the checkout's ``.anchors/``
(or ``shared/anchors``, or ``$FLASHMLA_PATH``), FlashInfer and DeepGEMM where the environment
has them installed (``.anchors/flashinfer/install.sh`` puts them on the GPU machine), and the
upstream remap tilings from ``benchmarks/baselines``. Repository tooling: the package's
``sparse-mla bench`` only imports what its caller names (``sparse_mla.bench.anchors``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparse_mla.bench.anchors import ANCHOR_MODULES, Anchors, import_module_or_why

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding .anchors/ and benchmarks/


def _anchor_dirs() -> list[Path]:
    roots = dict.fromkeys([Path.cwd(), ROOT])
    return [r / d for r in roots for d in (".anchors", "shared/anchors", "../shared/anchors")]


def _import_from(folder: Path, name: str) -> tuple[Any, str | None]:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    mod, why = import_module_or_why(name)
    return mod, why and f"{why} (from {folder})"


def import_flashmla() -> tuple[Any, str | None]:
    """FlashMLA's ``flash_mla`` from ``$FLASHMLA_PATH`` or ``.anchors/flashmla`` (or
    ``shared/anchors/flashmla``): (module, None), or (None, why not)."""
    env = os.environ.get("FLASHMLA_PATH")
    for c in ([Path(env)] if env else []) + [d / "flashmla" for d in _anchor_dirs()]:
        if (c / "flash_mla").is_dir():
            return _import_from(c, "flash_mla")
    return None, "FlashMLA not found ($FLASHMLA_PATH, .anchors/flashmla)"


def import_vllm() -> tuple[Any, str | None]:
    """vLLM's Triton sparse MLA kernel from ``.anchors/vllm_triton_sparse_mla.py`` (or
    ``shared/anchors/``): (module, None), or (None, why not)."""
    for c in _anchor_dirs():
        if (c / "vllm_triton_sparse_mla.py").is_file():
            return _import_from(c, "vllm_triton_sparse_mla")
    return None, "vllm_triton_sparse_mla.py not found (.anchors/)"


def remap_layouts() -> dict[str, Callable[..., Any]]:
    """The upstream remap tilings (name -> ``f(K, count_valid=, compact=)``) of
    ``benchmarks/baselines/remap_layouts.py``, loaded by path so that this module imports
    both as ``benchmarks.harness`` and as ``harness`` (from a script in ``benchmarks/``)."""
    path = ROOT / "benchmarks" / "baselines" / "remap_layouts.py"
    spec = importlib.util.spec_from_file_location("_sparse_mla_remap_baselines", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.LAYOUTS)


def repo_anchors(cuda: bool) -> Anchors:
    """Every anchor this checkout has: the remap tilings always, the attention anchors,
    FlashInfer (top-k) and DeepGEMM (indexer logits) on a CUDA device only (they do not run
    in the interpreter)."""
    found = Anchors(remap_layouts=remap_layouts())
    if not cuda:
        found.notes.append("anchors: not run (no CUDA device)")
        return found
    (found.flashmla, fm_why), (found.vllm, vl_why) = import_flashmla(), import_vllm()
    (found.flashinfer, fi_why) = import_module_or_why(ANCHOR_MODULES["flashinfer"])
    (found.deepgemm, dg_why) = import_module_or_why(ANCHOR_MODULES["deepgemm"])
    whys = (fm_why, vl_why, fi_why, dg_why)
    found.notes += [f"anchor skipped: {why}" for why in whys if why]
    return found
