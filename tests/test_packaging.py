"""What ships: the version in one place, the licence, py.typed, and a wheel that installs into
a fresh virtual environment and runs a kernel there (no network: torch and triton are this
environment's, seen through a .pth file)."""

from __future__ import annotations

import email
import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest
import torch
import triton

import sparse_mla
from sparse_mla.cli import main as cli_main

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+

# Runs in the fresh environment: the installed package, its console script, one kernel call.
SMOKE = """
import pathlib, sys, torch, sparse_mla
assert pathlib.Path(sparse_mla.__file__).is_relative_to(sys.prefix), sparse_mla.__file__
dev = "cuda" if sparse_mla.mode() == "cuda" else "cpu"
logits = torch.randn(3, 100, device=dev)
lens = torch.tensor([100, 40, 0], dtype=torch.int32, device=dev)
got = sparse_mla.select_topk(logits, lens, k=8)
want = logits.masked_fill(torch.arange(100, device=dev) >= lens[:, None], -torch.inf)
want = want.topk(8).indices.sort(dim=1).values.int()
assert torch.equal(got[:2], want[:2]) and bool((got[2] == -1).all()), (got, want)
print(sparse_mla.__version__, sparse_mla.mode())
"""


def test_version_is_declared_once():
    """pyproject takes the version from sparse_mla.__version__; nothing else states it."""
    project = PYPROJECT.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M)
    assert re.search(r'^dynamic = \["version"\]$', project, re.M)
    assert 'version = { attr = "sparse_mla.__version__" }' in PYPROJECT
    from packaging.version import Version

    assert str(Version(sparse_mla.__version__)) == sparse_mla.__version__  # PEP 440, normalised
    assert sparse_mla.info()["sparse_mla"] == sparse_mla.__version__


def test_cli_version(capsys):
    for flag in ("--version", "-V"):
        assert cli_main([flag]) == 0
        assert capsys.readouterr().out == f"sparse-mla {sparse_mla.__version__}\n"


def test_licence_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.splitlines()[1].strip() == "Apache License"
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert '\nlicense = "Apache-2.0"\n' in PYPROJECT
    assert (ROOT / "src" / "sparse_mla" / "py.typed").exists()


def _build_wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    """``pip wheel`` of a copy of the sources (the checkout stays clean), offline, with this
    environment's setuptools; skips where that cannot build."""
    try:
        from packaging.version import Version

        setuptools_version = Version(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no setuptools here: cannot build the wheel offline")
    need = re.search(r'requires = \["setuptools>=([\d.]+)"\]', PYPROJECT).group(1)
    if setuptools_version < Version(need):
        pytest.skip(f"setuptools {setuptools_version} < {need}: cannot build the wheel offline")
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist), str(tree)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("sparse_mla-*.whl")
    return wheel


def test_wheel_installs_into_a_fresh_venv_and_runs_a_kernel(tmp_path: pathlib.Path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"sparse_mla-{sparse_mla.__version__}.dist-info"
        metadata = email.message_from_bytes(z.read(f"{info}/METADATA"))
        licence = z.read(f"{info}/licenses/LICENSE").decode()
    assert wheel.name.startswith(f"sparse_mla-{sparse_mla.__version__}-")
    assert metadata["Version"] == sparse_mla.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert licence == (pathlib.Path(__file__).parents[1] / "LICENSE").read_text()
    assert "sparse_mla/py.typed" in names
    assert "sparse_mla/ops/topk/radix.py" in names and "sparse_mla/testing/cases.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    deps = {pathlib.Path(m.__file__).parents[1] for m in (torch, triton)}
    (pathlib.Path(purelib) / "_this_torch.pth").write_text("".join(f"{d}\n" for d in deps))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    run = subprocess.run([python, "-c", SMOKE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[0] == sparse_mla.__version__
    script = subprocess.run([env / "bin" / "sparse-mla", "--version"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert script.stdout == f"sparse-mla {sparse_mla.__version__}\n", script.stderr[-2000:]
