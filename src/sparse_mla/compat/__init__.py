"""Drop-in entry points under other engines' names (see :mod:`sparse_mla.compat.vllm`)."""
