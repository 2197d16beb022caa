"""One multi-process run per world size, shared by the DCP tests (starting processes is
the slow part on a CPU): every scenario of ``workers.SCENARIOS`` runs once on every rank."""

from __future__ import annotations

import os
import secrets

import pytest

from . import workers
from ._spawn import run_ranks

_RUNS: dict[int, tuple[int, list[dict]]] = {}


def dcp_run(world: int) -> tuple[int, list[dict]]:
    """(seed, per-rank results) of the run on ``world`` ranks, started on first use."""
    if world not in _RUNS:
        env = os.environ.get("SPARSE_MLA_SEED")
        seed = int(env) if env else secrets.randbits(20)
        _RUNS[world] = (seed, run_ranks(world, workers.run_all, seed, timeout_s=400))
    return _RUNS[world]


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def world(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def scenario_result(world: int, request: pytest.FixtureRequest):
    """Call with a scenario name: fails the test with every rank's reason, if any."""

    def check(name: str) -> None:
        seed, results = dcp_run(world)
        request.node.user_properties.append(("seed", seed))
        bad = {r: res[name] for r, res in enumerate(results) if res[name] is not None}
        assert not bad, f"world {world}, seed {seed} (rerun with SPARSE_MLA_SEED={seed}):\n" + (
            "\n".join(f"rank {r}: {why}" for r, why in bad.items())
        )

    return check
