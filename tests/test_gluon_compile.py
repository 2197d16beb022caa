"""Every Gluon (sm_90) attention variant the dispatch can launch compiles for Hopper on a CPU,
within the shared-memory opt-in limit and without register spills, under this Triton and
under the GPU machine's (Triton 3.6, a venv ``make test`` builds and names in
``$SPARSE_MLA_TRITON36_PYTHON``). Gluon has no interpreter: this is the only CI check of
those kernels; they run on the GPU in ``tests/ops/test_attention_sm90_gpu.py`` (``pytest -m
gpu``) and are timed by ``benchmarks/gpu_attention_sm90.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("gluon_compile.py")


def _env(tmp_path: Path) -> dict:
    """The compiler's environment (this process runs kernels interpreted; a venv with only
    Triton has no numpy for the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               TRITON_CACHE_DIR=str(tmp_path / "cache"))  # fmt: skip
    return env


def _compile(python: str, tmp_path: Path) -> str:
    res = subprocess.run([python, str(SCRIPT)], env=_env(tmp_path), capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    return res.stdout


needs_backend = pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None or torch.cuda.is_available(),
    reason="needs Triton's NVIDIA backend; on a GPU the kernels run for real",
)


@needs_backend
def test_gluon_variants_compile_for_sm90(tmp_path: Path) -> None:
    out = _compile(sys.executable, tmp_path)
    assert "Gluon variants compiled for sm_90 within limits" in out, out


@needs_backend
def test_gluon_variants_compile_for_sm90_with_the_gpu_machines_triton(tmp_path: Path) -> None:
    python = os.environ.get("SPARSE_MLA_TRITON36_PYTHON")
    if not python:
        pytest.skip("SPARSE_MLA_TRITON36_PYTHON unset (make test builds that venv)")
    version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"],
                             env=_env(tmp_path), capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
    assert version.startswith("3.6"), version
    out = _compile(python, tmp_path)
    assert "Gluon variants compiled for sm_90 within limits" in out, out
