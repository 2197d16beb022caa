"""The child-process helper of the hang-prone GPU tests (``child_process.run_in_child``):
a result comes back, an exception, a crash and a hang each fail the caller, a hang within
the limit. Children that do not import torch: each starts in well under a second."""

from __future__ import annotations

import os
import time

import pytest
from child_process import run_in_child


def _add(a: int, b: int) -> int:
    return a + b


def _raise(message: str) -> None:
    raise ValueError(message)


def _die(code: int) -> None:
    os._exit(code)


def _hang() -> None:
    while True:
        time.sleep(1)


def test_the_result_comes_back():
    assert run_in_child(_add, 2, 3, timeout_s=60) == 5


def test_an_exception_fails_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)raised in its child.*ValueError: no good"):
        run_in_child(_raise, "no good", timeout_s=60)


def test_a_crash_fails_with_its_exit_code():
    with pytest.raises(AssertionError, match="died without answering .exit code 3"):
        run_in_child(_die, 3, timeout_s=60)


def test_a_hang_fails_at_the_limit():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish within 3 s \(killed\)"):
        run_in_child(_hang, timeout_s=3)
    assert time.monotonic() - start < 30
