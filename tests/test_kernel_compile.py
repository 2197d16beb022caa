"""The quick verification sweep passes, and the kernel launches it makes compile for every
GPU target the README lists, with no GPU.

The rest of the suite runs the kernels in Triton's interpreter, which accepts code the GPU
compiler rejects (tests/kernel_compile.py says why and how this works). The longest test:
the sweep is run and its launches recorded by two interpreter processes side by side, then
compiled by two others: every kind of launch for Hopper (sm_90), the GPU the kernels are
tuned and checked on, and a sample (each kernel's first launch of each cache format, 25 of
about 450 kinds) for the other targets, whose compilers differ from it in the MMA, the fp8
support and PDL but not in what a launch's integer values change (about 30 CPU-seconds a
target; every kind for every target: ``python tests/kernel_compile.py compile ...
--targets=all``). This is the suite's run of `sparse-mla verify --quick`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("kernel_compile.py")
# As tests/kernel_compile.py's TARGETS (this module does not import the script).
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942")
PARTS = 2  # processes sharing the recording and the compiling


def _has_nvidia_backend() -> bool:
    return importlib.util.find_spec("triton.backends.nvidia") is not None


def _run_parts(
    step: str, files: Callable[[int], list[Path]], env: dict, timeout: int, options=()
) -> str:
    """Run one step in PARTS processes side by side (the suite has two cores to itself at
    its end, where this test runs); fails with their output if one fails."""
    logs = [files(0)[0].with_name(f"{step}{i}.log") for i in range(PARTS)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            argv = [sys.executable, str(SCRIPT), step, *map(str, files(i)), *options,
                    f"--part={i}/{PARTS}"]  # fmt: skip
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=timeout) for p in procs]
    text = "\n".join(log.read_text()[-6000:] for log in logs)
    assert codes == [0] * PARTS, text
    return text


# On a GPU every launch compiles for real in the rest of the suite, and the lease runs the
# sweep itself. (There the recording, which runs the sweep in the interpreter, also failed a
# few expansion cases with Triton 3.6's interpreter; Triton 3.9's, which CI runs, passes them.)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles every launch for real")
def test_quick_sweep_passes_and_its_launches_compile_for_every_target(tmp_path: Path) -> None:
    # The recording runs every case of `sparse-mla verify --quick` and fails if one does:
    # `make test` relies on it instead of running the quick sweep a second time.
    recorded = [tmp_path / f"launches{i}.json" for i in range(PARTS)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "1"
    _run_parts("record", lambda i: [recorded[i]], env, timeout=1800)
    if not _has_nvidia_backend():
        pytest.skip("the quick sweep passed; Triton without its NVIDIA backend cannot compile")
    # A fresh cache: every kernel is compiled here, none found from an earlier run.
    env.update(
        TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "c")
    )
    sampled = [t for t in TARGETS if t != "sm_90"]
    options = (f"--targets={','.join(TARGETS)}", f"--sample={','.join(sampled)}")
    text = _run_parts("compile", lambda i: recorded, env, timeout=1800, options=options)
    for target in TARGETS:  # each part compiled its share for every target
        assert sum(line.startswith(f"{target}: ") for line in text.splitlines()) == PARTS, text
