"""Run one function in a fresh process under a wall-clock limit, for tests whose failure can
be a hang rather than an exception (a Gluon kernel waiting on the wrong mbarrier phase spins
forever): the test fails naming the limit instead of stalling the run."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any


def _entry(conn, fn: Callable[..., Any], args: tuple) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException:  # report anything, the parent decides
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()


def run_in_child(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``fn(*args)`` in a spawned process (``fn`` importable, arguments and result
    picklable); returns its result. Raises AssertionError when it raised (with its
    traceback), died without answering (a crash: its exit code), or had not answered after
    ``timeout_s`` seconds (then it is killed)."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_entry, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()  # the child holds the only writer: its exit reads as end of file
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        if not recv.poll(timeout_s):
            raise AssertionError(f"{name}{args} did not finish within {timeout_s:g} s (killed)")
        ok, value = recv.recv()
    except EOFError:
        proc.join(timeout=5)
        raise AssertionError(
            f"{name}{args} died without answering (exit code {proc.exitcode})"
        ) from None
    finally:
        if proc.is_alive():
            proc.kill()  # only the process started here
        proc.join()
        recv.close()
    if not ok:
        raise AssertionError(f"{name}{args} raised in its child process:\n{value}")
    return value
