"""Drop-in entry points under other engines' names (see :mod:`sparse_mla.compat.vllm`)."""

from . import vllm

__all__ = ["vllm"]
