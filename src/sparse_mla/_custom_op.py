"""How a public kernel entry becomes a ``torch.library`` custom op, beside its wrapper.

A leaf module (it imports nothing of the package's ops), so each op module registers its
own op and nothing imports every op. Under ``torch.compile`` a public function calls its op
(:func:`compiling`); eagerly it runs its own code, and the op's implementation is that same
eager code (:func:`run_eager`), so the eager path never pays the dispatcher (several us a
call) and both paths give the same results. See docs/DEVELOPING.md, "Custom ops".
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, NamedTuple

import torch


class OpEntry(NamedTuple):
    """One registered op: the op, the public function it stands for, and how the op
    represents those public parameters its schema cannot take as they are (``public name ->
    the op parameters standing for it``, in order)."""

    op: Any
    public: Callable
    represents: Mapping[str, tuple[str, ...]]


OPS: dict[str, OpEntry] = {}
"""Every registered op by name (``torch.ops.sparse_mla.<name>``), in registration order."""


def custom_op(
    name: str,
    *,
    public: Callable,
    mutates_args: tuple[str, ...],
    represents: Mapping[str, tuple[str, ...]] | None = None,
):
    """Register the decorated function as ``sparse_mla::<name>``, mutating ``mutates_args``,
    with a fake that does nothing (every op is an out-variant: it returns nothing), and
    record it in :data:`OPS`. Its parameters are ``public``'s, in the same order, with the
    ``represents`` substitutions (``tests/test_custom_ops.py`` checks this); it declares no
    defaults, since the public function passes every argument."""

    def register(fn: Callable) -> Any:
        op = torch.library.custom_op(f"sparse_mla::{name}", mutates_args=mutates_args)(fn)
        op.register_fake(lambda *args, **kwargs: None)
        OPS[name] = OpEntry(op, public, dict(represents or {}))
        return op

    return register


# Whether the caller is being traced by ``torch.compile`` (then it calls its op). The
# function itself, not a wrapper: it is on every eager call's path.
compiling = torch.compiler.is_compiling


def _with_compiling_flag(value: bool, fn: Callable, args: tuple, kwargs: dict) -> Any:
    flag = getattr(torch.compiler, "_is_compiling_flag", False)
    if flag == value:
        return fn(*args, **kwargs)
    torch.compiler._is_compiling_flag = value
    try:
        return fn(*args, **kwargs)
    finally:
        torch.compiler._is_compiling_flag = flag


def run_eager(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """Run a public function's own (eager) path from its op's implementation, even when that
    runs inside a compile session (where ``compiling()`` is True and it would call the op)."""
    return _with_compiling_flag(False, fn, args, kwargs)


def through_op(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """Call a public function by the path ``torch.compile`` takes (its op), eagerly: how the
    tests compare the two paths without compiling."""
    return _with_compiling_flag(True, fn, args, kwargs)


def encode_config(config: Any) -> str | None:
    """A frozen config dataclass as an op's string argument: the repr of its fields' values
    in order (attribute reads, which Dynamo folds to a constant); None and strings as they
    are."""
    if config is None or isinstance(config, str):
        return config
    return repr(tuple(getattr(config, f.name) for f in dataclasses.fields(config)))


@lru_cache(maxsize=256)
def decode_config(text: str | None, cls: type, *, arg: str = "config", auto: bool = False) -> Any:
    """The ``cls`` instance an :func:`encode_config` string stands for (None stays None, and
    ``"auto"`` too where ``auto``). The caller names its class: no central table (which would
    have to import every op). The fields' values are checked by the public function."""
    if text is None or (auto and text == "auto"):
        return text
    try:
        fields = ast.literal_eval(text)
        if isinstance(fields, tuple):
            return cls(*fields)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    names = tuple(f.name for f in dataclasses.fields(cls))
    also = "'auto', " if auto else ""
    raise ValueError(
        f"{arg} must be None, {also}or the repr of a tuple of the "
        f"{len(names)} {cls.__name__} fields {names} (as encode_config makes it), got {text!r}"
    )
