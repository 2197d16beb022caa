"""What differs between the Tritons the Gluon kernels are compiled with (3.6 on the GPU
machine, 3.9 in CI), in one place. Imports only Triton."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# Triton 3.9 renamed the CTA barrier (3.6: thread_barrier); a barrier inside a partition
# synchronises that partition's warps.
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# ... the shared-memory view of another type (3.6: _reinterpret) ...
OLD_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "_reinterpret"))
# ... and the cp.async copy (3.6: async_copy_global_to_shared, 3.9: async_load).
cp_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
