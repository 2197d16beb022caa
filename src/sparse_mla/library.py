"""The library's kernel entries as ``torch.library`` custom ops: ``torch.ops.sparse_mla.*``.

``torch.compile`` cannot see through a Triton launch made from Python that checks and
sizes its arguments, so every public kernel entry is also a custom op, defined beside its
public function through :mod:`sparse_mla._custom_op` (docs/DEVELOPING.md, "Custom ops").
This module only gathers them: importing it imports every op module (so every op is
registered), and nothing in the package imports it.

Not ops: the DCP calls with a collective (``global_topk``, ``combine``) are Python over
their local ops (``local_topk_candidates``, ``merge_topk_candidates``, ``rescale_partial``)
and the collective, which Dynamo traces itself; ``DecodeMetadataBuilder.build`` and the
compat entries are Python over the ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from . import dcp  # noqa: F401  (registers the DCP ops)
from ._custom_op import OPS as _REGISTRY
from ._custom_op import decode_config, encode_config, through_op
from .ops import (  # noqa: F401
    attention,
    compressor,
    decode_metadata,
    indexer,
    kv_cache,
    remap,
    topk,
)

OPS: tuple[str, ...] = tuple(_REGISTRY)
"""Names of the custom ops, ``torch.ops.sparse_mla.<name>``."""

__all__ = ["OPS", "decode_config", "encode_config", "op_path"]


def op_path(name: str) -> Callable:
    """The public function of op ``name`` taking the path ``torch.compile`` takes (through
    ``torch.ops.sparse_mla.<name>``), called eagerly: the same arguments and results as the
    public function. For tests and for timing the op path."""
    return functools.partial(through_op, _REGISTRY[name].public)


def __getattr__(name: str) -> Callable:
    """``library.<op name>``: :func:`op_path` (the name the adapters here used to have)."""
    if name in _REGISTRY:
        return op_path(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
