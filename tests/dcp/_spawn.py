"""Run a function on W local processes joined in a gloo group (the DCP tests' harness).

Each rank is a fresh spawned process (kernels in Triton's interpreter), joined
through a FileStore in a temporary directory (no port to pick). Every collective has a
timeout, and the whole run a wall-clock limit after which the processes still running are
killed and the test fails naming them, so a hang shows as a failure, never as a stuck CI.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


def _entry(rank: int, world: int, store: str, results, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        results.put((rank, fn(dist.group.WORLD, rank, world, *args)))
    except BaseException:  # report anything, the parent decides
        results.put((rank, {"<rank crashed>": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args, timeout_s: float = 300) -> list[dict]:
    """``fn(group, rank, world, *args)`` on ``world`` processes; returns each rank's result
    (a picklable dict), in rank order. Raises AssertionError naming the ranks that crashed
    or did not finish within ``timeout_s``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, world, store, results, fn, args), daemon=True)
            for r in range(world)
        ]
        # The children run the kernels in Triton's interpreter on CPU tensors (gloo), also
        # on a GPU machine: they inherit the environment as it is when they start.
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            for p in procs:
                p.start()
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, res = results.get(timeout=1.0)
                got[rank] = res
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in stuck:
            procs[r].kill()  # only the processes started here
            procs[r].join()
    missing = [r for r in range(world) if r not in got]
    if missing:
        raise AssertionError(
            f"world {world}: ranks {missing} reported nothing within {timeout_s} s "
            f"(still running, killed: {stuck}; exit codes {[p.exitcode for p in procs]})"
        )
    crashed = {r: got[r]["<rank crashed>"] for r in range(world) if "<rank crashed>" in got[r]}
    if crashed:
        raise AssertionError(f"world {world}: ranks crashed:\n" + "\n".join(crashed.values()))
    return [got[r] for r in range(world)]
