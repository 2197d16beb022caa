"""Shared fixtures: a fresh, printed random seed per test (reproduce with SPARSE_MLA_SEED)."""

from __future__ import annotations

import os
import random
import secrets

import pytest
import torch

from sparse_mla import _runtime


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu``-marked tests where kernels do not compile for a CUDA device."""
    if not _runtime.INTERPRETER and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu on a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh seed per test (or ``$SPARSE_MLA_SEED``), printed and kept in the report."""
    env = os.environ.get("SPARSE_MLA_SEED")
    value = int(env) if env else secrets.randbits(31)
    print(f"{request.node.nodeid}: seed={value} (rerun with SPARSE_MLA_SEED={value})")
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed: int) -> random.Random:
    """A ``random.Random`` seeded from :func:`seed`; also seeds torch's global generator."""
    torch.manual_seed(seed)
    return random.Random(seed)


@pytest.fixture
def huge_int32(tmp_path) -> torch.Tensor:
    """An int32 tensor of 2**31 + 256 elements backed by a sparse file (no memory is used
    until written): room for views whose element offsets pass int32."""
    path = tmp_path / "huge.bin"
    n = 2**31 + 256
    with open(path, "wb") as f:
        f.truncate(4 * n)
    return torch.from_file(str(path), shared=True, size=n, dtype=torch.int32)


class E4M3Bits:
    """The attention and logits kernels decode e4m3 on the integer bits after :meth:`on`, as
    on a GPU without e4m3 (sm_80/86); ``flags`` has each later launch's ``E4M3_BITS``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch, self.flags = monkeypatch, []

    def on(self) -> None:
        from sparse_mla._launch import clear_host_plans
        from sparse_mla.ops.attention import api as attention_api
        from sparse_mla.ops.indexer import api as indexer_api

        for module in (attention_api, indexer_api):
            launch = module.launch

            def spy(kernel, grid, args, kwargs, key=None, launch=launch):
                self.flags.append(kwargs.get("E4M3_BITS"))
                launch(kernel, grid, args, kwargs, key)

            self.monkeypatch.setattr(module, "e4m3_bits", lambda device: True)
            self.monkeypatch.setattr(module, "launch", spy)
        clear_host_plans()  # plans cached with the device's own answer


@pytest.fixture
def e4m3_bits(monkeypatch: pytest.MonkeyPatch):
    """See :class:`E4M3Bits`; the host plans made under it are dropped afterwards."""
    from sparse_mla._launch import clear_host_plans

    yield E4M3Bits(monkeypatch)
    clear_host_plans()
