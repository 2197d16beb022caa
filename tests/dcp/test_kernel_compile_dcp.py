"""The DCP kernels compile for every GPU target with no GPU, as tests/test_kernel_compile.py
does for the other ops (the interpreter accepts code the GPU compiler rejects)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="Triton without its NVIDIA backend",
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles every launch for real")
def test_dcp_kernels_compile_for_every_target(tmp_path: Path) -> None:
    launches = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run(
        [sys.executable, str(HERE / "record_launches.py"), str(launches)],
        env=env,
        check=True,
        timeout=300,
    )
    env.update(
        TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "c")
    )
    argv = [sys.executable, str(HERE.parent / "kernel_compile.py"), "compile", str(launches)]
    subprocess.run([*argv, "--targets=all"], env=env, check=True, timeout=600)
