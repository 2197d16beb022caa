"""The interpreter is the library's own choice: importing sparse_mla sets nothing for the
process (no ``TRITON_INTERPRET``), other Triton code keeps its own mode, and the library's
kernels still run on CPU tensors where it interprets them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sparse_mla import _runtime

# Imports Triton first on purpose (the order used to matter), then the library; reports what
# a user of the process would see.
_PROBE = textwrap.dedent(
    """
    import json, os, sys
    before = dict(os.environ)
    import triton
    import torch
    import sparse_mla
    from sparse_mla import _runtime
    from triton.runtime.jit import JITFunction

    host_call = JITFunction.__call__

    @triton.jit
    def users_kernel(x):  # another Triton user's kernel, decorated after the import
        pass

    report = {
        "environ_untouched": dict(os.environ) == before,
        "interpreter": _runtime.INTERPRETER,
        "users_kernel": type(users_kernel).__name__,
        "library_kernel": type(_runtime.pdl_prologue).__name__,
    }
    if _runtime.INTERPRETER:
        lens = torch.tensor([5, 9, 0], dtype=torch.int32)
        report["dcp_local_seq_lens"] = sparse_mla.dcp_local_seq_lens(
            lens, dcp_size=2, dcp_rank=1).tolist()
        logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
        report["select_topk"] = sparse_mla.select_topk(
            logits, torch.tensor([4], dtype=torch.int32), k=2).tolist()
    # Interpreting a library kernel patches nothing beyond its own launch.
    report["host_call_restored"] = JITFunction.__call__ is host_call
    print(json.dumps(report))
    """
)


def _probe(tmp_path, **env: str) -> dict:
    script = tmp_path / "probe.py"  # a file: triton.jit reads the function's source
    script.write_text(_PROBE)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TRITON_INTERPRET", "SPARSE_MLA_INTERPRET")}  # fmt: skip
    environ.update(env)
    done = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_leaves_the_process_alone_and_kernels_run_interpreted(tmp_path):
    got = _probe(tmp_path, SPARSE_MLA_INTERPRET="1")
    assert got["environ_untouched"] and got["interpreter"]
    assert got["users_kernel"] == "JITFunction"  # still compiled for its GPU
    assert got["library_kernel"] == "_InterpretedKernel"
    assert got["dcp_local_seq_lens"] == [2, 4, 0]
    assert got["select_topk"] == [[1, 3]]  # tl.sum & co., compiler-mode here, interpreted
    assert got["host_call_restored"]


def test_the_default_follows_the_device(tmp_path):
    """Neither variable set: the interpreter exactly when no CUDA device is present."""
    got = _probe(tmp_path)
    assert got["environ_untouched"]
    assert got["interpreter"] == (not torch.cuda.is_available())
    assert got["users_kernel"] == "JITFunction"
    if got["interpreter"]:  # a CPU-only machine, as CI: the library still runs
        assert got["dcp_local_seq_lens"] == [2, 4, 0]


@pytest.mark.parametrize(
    "environ, cuda, want",
    [
        ({}, False, True),
        ({}, True, False),
        ({"SPARSE_MLA_INTERPRET": "1"}, True, True),
        ({"SPARSE_MLA_INTERPRET": "0", "TRITON_INTERPRET": "1"}, False, False),
        ({"TRITON_INTERPRET": "1"}, True, True),  # the process chose for everyone
        ({"TRITON_INTERPRET": "0"}, False, False),  # tests/kernel_compile.py: compile on a CPU
        ({"SPARSE_MLA_INTERPRET": "true"}, True, True),
        ({"SPARSE_MLA_INTERPRET": ""}, True, False),  # empty: as unset
    ],
)
def test_interpreter_requested(monkeypatch, environ, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert _runtime.interpreter_requested(environ) is want
