"""Where the library's kernels run, and the launch helpers every op shares.

The library decides once, at import, whether its own kernels run compiled for CUDA or in
Triton's CPU interpreter (:data:`INTERPRETER`): ``SPARSE_MLA_INTERPRET`` when set (1/true/yes
or 0/false/no), else ``TRITON_INTERPRET`` when the process set it, else the interpreter exactly
when no CUDA device is available. It changes nothing for the rest of the process: the
environment is left as it is, and the choice applies to the functions decorated with
:func:`jit` (every kernel and device function of the library) instead of ``triton.jit``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

_TRUE = ("1", "true", "yes", "on", "y")  # as Triton reads TRITON_INTERPRET


def interpreter_requested(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """The library's choice of Triton's interpreter for ``environ`` (see the module notes)."""
    for name in ("SPARSE_MLA_INTERPRET", "TRITON_INTERPRET"):
        value = environ.get(name, "").strip().lower()
        if value:
            return value in _TRUE
    return not torch.cuda.is_available()


INTERPRETER: bool = interpreter_requested()


def jit(fn: Callable | None = None, **kwargs: Any) -> Any:
    """``triton.jit`` for the library's kernels and device functions: run by Triton's
    interpreter when :data:`INTERPRETER`, compiled otherwise, whatever the process's
    ``TRITON_INTERPRET`` (which ``triton.jit`` reads) says."""

    def decorate(fn: Callable) -> Any:
        return _InterpretedKernel(fn, **kwargs) if INTERPRETER else JITFunction(fn, **kwargs)

    return decorate if fn is None else decorate(fn)


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


if INTERPRETER:
    from triton.runtime.interpreter import InterpretedFunction

    class _InterpretedKernel(InterpretedFunction):
        """A library function run by Triton's interpreter. While one of its launches runs,
        the ``triton.jit`` functions it calls that were made for the compiler (Triton's own
        ``tl.sum``, ``tl.sort``..., decorated when Triton was imported without
        ``TRITON_INTERPRET``) are interpreted too."""

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            # The launch, not ``run``: Triton 3.3's launches do not go through ``run``.
            launch = super().__getitem__(grid)

            def interpreted_launch(*args: Any, **kwargs: Any) -> Any:
                with _jit_calls_interpreted():
                    return launch(*args, **kwargs)

            return interpreted_launch

    _TWINS: dict[Callable, InterpretedFunction] = {}
    _DEPTH = [0]

    def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
        twin = _TWINS.get(self.fn)
        if twin is None:
            twin = _TWINS[self.fn] = InterpretedFunction(self.fn)
        return twin(*args, **kwargs)

    @contextmanager
    def _jit_calls_interpreted() -> Iterator[None]:
        """``JITFunction.__call__`` (which otherwise raises: a device function called from
        the host) interprets the function, for the duration of the block. The interpreter
        patches ``triton.language`` in the same way while it runs a kernel."""
        saved = JITFunction.__call__
        if _DEPTH[0] == 0:
            JITFunction.__call__ = _call_interpreted
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                JITFunction.__call__ = saved

    def _index_scalars_by_their_element() -> None:
        """Triton before 3.8 interprets ``range(n)`` on a loaded scalar (a size-1 array) with
        ``int(array)``, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted
        to Python scalars"). Give its interpreter 3.8's ``__index__``: the one element."""
        from triton.runtime import interpreter

        original = getattr(interpreter, "_patch_lang_tensor", None)
        if _triton_version() >= (3, 8) or original is None:
            return

        def index(self: Any) -> int:
            return int(self.handle.data.reshape(-1)[0])

        def patch_lang_tensor(tensor: Any, *scope: Any) -> None:
            original(tensor, *scope)
            if scope:  # 3.4 on: the scope restores what it set after the launch
                scope[0].set_attr(tensor, "__index__", index)
            else:
                tensor.__index__ = index

        interpreter._patch_lang_tensor = patch_lang_tensor

    _index_scalars_by_their_element()


try:  # grid dependency control (programmatic dependent launch), Triton 3.3 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover  (older Triton: PDL stays off)
    gdc_launch_dependents = gdc_wait = None


def mode() -> str:
    """'interpreter' when kernels run through Triton's CPU interpreter, else 'cuda'."""
    return "interpreter" if INTERPRETER else "cuda"


def default_device() -> torch.device:
    """The device kernels run on in this process: CUDA, or the CPU under the interpreter."""
    return torch.device("cpu") if INTERPRETER else torch.device("cuda")


def check_kernel_device(device: torch.device, name: str = "device") -> None:
    """Raise ``ValueError`` unless kernels can run on ``device``: CUDA, or under the
    interpreter also the CPU (a meta tensor has no memory to run on)."""
    if device.type == "cuda" or (INTERPRETER and device.type == "cpu"):
        return
    if INTERPRETER:
        raise ValueError(
            f"{name} is on {device}, but the kernels run on the GPU or, in interpreter mode, "
            "the CPU: pass CUDA or CPU tensors"
        )
    raise ValueError(f"{name} is on {device}, but the kernels run on the GPU: pass CUDA tensors")


def canonical_device(device: torch.device | str | None) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:0``), so it compares equal to
    a tensor's ``.device``; None means :func:`default_device`. Raises ``ValueError`` for a
    device with no memory to use (meta, ...): buffers may live on the CPU (references use
    them there), but kernel calls still check their tensors with :func:`check_kernel_device`."""
    d = default_device() if device is None else torch.device(device)
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device is on {d}, but buffers live on the GPU or the CPU")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def info() -> dict[str, str]:
    """Execution mode and versions, as printed by ``sparse-mla info``."""
    from . import __version__

    d = {
        "sparse_mla": __version__,
        "mode": mode(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if not INTERPRETER and torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
        d["cuda"] = str(torch.version.cuda)
    return d


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device, *, interpreter: int) -> int:
    """Multiprocessors of a CUDA ``device``; under the interpreter the fixed ``interpreter``
    value, so launch-shape choices stay deterministic (and exercised) on the CPU."""
    if device.type != "cuda":
        return interpreter
    return torch.cuda.get_device_properties(canonical_device(device)).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def target_has_e4m3(target: Any) -> bool:
    """Whether Triton can emit float8_e4m3fn (``tl.float8e4nv``: its types, pointers,
    conversions and dots) for a ``triton.backends.compiler.GPUTarget``, as its backend says
    (NVIDIA: sm_89 on; AMD: per architecture)."""
    from triton.compiler.compiler import make_backend

    return "fp8e4nv" in make_backend(target).parse_options({}).supported_fp8_dtypes


@functools.lru_cache(maxsize=16)
def e4m3_bits(device: torch.device) -> bool:
    """Whether kernels reading e4m3 on ``device`` decode it on the integer bits (``E4M3_BITS``
    of the attention and logits kernels, ``ops/_common/e4m3.py``) because Triton has no
    e4m3 for it (an A100, an RTX 30xx). False under the interpreter."""
    if INTERPRETER or device.type != "cuda":
        return False
    from triton.backends.compiler import GPUTarget

    if torch.version.hip:
        target = triton.runtime.driver.active.get_current_target()
    else:
        major, minor = torch.cuda.get_device_capability(canonical_device(device))
        target = GPUTarget("cuda", 10 * major + minor, 32)
    return not target_has_e4m3(target)


@functools.lru_cache(maxsize=16)
def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (Hopper on, a
    Triton with grid dependency control, not the interpreter)."""
    if INTERPRETER or gdc_wait is None or device.type != "cuda" or torch.version.hip:
        return False  # griddepcontrol is NVIDIA PTX
    return torch.cuda.get_device_capability(canonical_device(device))[0] >= 9


def pdl_launch(device: torch.device, mode: int, enable_pdl: bool | None = None) -> dict:
    """Launch keywords for a kernel that starts with ``pdl_prologue(PDL)``: ``PDL=mode`` with
    ``launch_pdl`` where :func:`pdl_supported`, else ``PDL=0`` (mode 0 also means off).
    ``enable_pdl``: the caller's per-call switch; False turns it off, None or True leave it
    on where supported."""
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise TypeError(f"enable_pdl must be a bool or None, got {type(enable_pdl).__name__}")
    if mode and enable_pdl is not False and pdl_supported(device):
        return dict(PDL=mode, launch_pdl=True)
    return dict(PDL=0)


@jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_pdl`` (PDL >= 1): wait until the
    previous kernel has finished and its writes are visible. PDL = 1 first lets the next
    kernel in the stream start launching its programs; PDL = 3 lets it start right after
    the wait (so at most two launches overlap, where 1 can chain several); PDL = 2 only
    waits. Nothing before it may touch global memory, since the previous kernel may still
    be writing any of it.

    PDL = 1 and 3 rely on the CUDA contract for whatever follows: a kernel launched after
    it *with* the PDL attribute must itself wait (``griddepcontrol.wait`` or
    ``cudaGridDependencySynchronize``) before it reads this kernel's outputs; kernels
    launched without the attribute start only after this one has finished."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL >= 1:
        gdc_wait()
    if PDL == 3:
        gdc_launch_dependents()
