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

INTERPRETER: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")
# On-chip gathers (``tl.gather``) exist from Triton 3.2 on.
HAS_GATHER: bool = hasattr(triton.language, "gather")


def mode() -> str:
    """'interpreter' when kernels run through Triton's CPU interpreter, else 'cuda'."""
    return "interpreter" if INTERPRETER else "cuda"


def default_device() -> torch.device:
    """The device kernels run on in this process: CUDA, or the CPU under the interpreter."""
    return torch.device("cpu") if INTERPRETER else torch.device("cuda")


def canonical_device(device: torch.device | str | None) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:0``), so it compares equal to
    a tensor's ``.device``; None means :func:`default_device`."""
    d = default_device() if device is None else torch.device(device)
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
