"""Where kernels run, and the launch helpers every op shares.

Importing this module decides the execution mode once: with a CUDA device present
kernels are compiled for it; without one Triton's interpreter runs them on the CPU
(``TRITON_INTERPRET=1`` is set for the process unless the caller already chose).
The choice must be made before any ``@triton.jit`` kernel is defined, which is why
``sparse_mla/__init__.py`` imports this module first.
"""

from __future__ import annotations

import functools
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (must follow the interpreter decision)
import triton.language as tl  # noqa: E402

INTERPRETER: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")

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


@triton.jit
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
