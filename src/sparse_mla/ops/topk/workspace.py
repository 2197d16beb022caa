"""The int32 scratch of the split path: its layout (compiled into the kernels) and
:func:`topk_workspace`.

Per row, ``WS_ROW_STRIDE`` int32:

* ``[0, STATE_OFF)``: the four 256-bin histograms of the radix passes. Zero on entry; the
  write pass zeroes them again, so a workspace stays reusable (one call at a time).
* ``STATE_OFF + 4 * p``: the selection state after pass ``p`` (prefix, need, done).
* ``CNT_OFF + 2 * s``: slice ``s``'s counts (keys > threshold, keys == threshold).
* ``PF_OFF``: the prefilter's candidate count and arrivals (one int64, count in the low
  word), a "row done" flag (a diagnostic: no kernel reads it), the threshold key and the
  next free buffer slot.
* ``PF_BMP``: a bitmap of the row's positions: the candidates (marking pass) or the selected
  (copying pass).
* ``PF_BUF``: the candidate buffer (``PF_CAP`` keys, then their positions; copying pass).

After every row's part, at the very end of the tensor given: the list of rows the
prefilter leaves to the radix launches (a count, then row ids). Only the histograms need
any content on entry: the prefilter's sample launch zeroes what it must, and the marking
pass writes every bitmap word its finish reads.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ... import _runtime
from ..._checks import check_int, check_tensor

MAX_SPLITS = 256  # programs per row of the split path
NUM_BINS = 256  # 8-bit digits, 4 passes over the 32-bit key
NUM_PASSES = 4
STATE_OFF = NUM_PASSES * NUM_BINS
CNT_OFF = STATE_OFF + 4 * (NUM_PASSES + 1)
PF_MAX_N = 262144  # longest rows the prefilter takes
PF_CAP = 4096  # candidates per row (the finishing tile); more: the radix passes
PF_OFF = CNT_OFF + 2 * MAX_SPLITS
PF_BMP = PF_OFF + 8
PF_BUF = PF_BMP + PF_MAX_N // 32
WS_ROW_STRIDE = PF_BUF + 2 * PF_CAP
assert PF_OFF % 2 == 0 and WS_ROW_STRIDE % 2 == 0  # each row's int64 counter stays aligned

# The same numbers as kernel constants.
NBINS = tl.constexpr(NUM_BINS)
NPASS = tl.constexpr(NUM_PASSES)
WS_HIST = tl.constexpr(0)
WS_STATE = tl.constexpr(STATE_OFF)
WS_CNT = tl.constexpr(CNT_OFF)
# + 0 count, + 1 arrivals (one int64), + 2 done flag, + 3 threshold key, + 4 next buffer slot
WS_PF = tl.constexpr(PF_OFF)
WS_PF_BMP = tl.constexpr(PF_BMP)
WS_PF_BUF = tl.constexpr(PF_BUF)
WS_PF_CAP = tl.constexpr(PF_CAP)


def topk_workspace_numel(rows: int) -> int:
    """int32 elements of the workspace the split path needs for ``rows`` rows (about 70 KB
    a row: histograms and counts of the radix passes, the prefilter's bitmap and buffer;
    then the list of rows the prefilter leaves to the radix passes, at the very end)."""
    check_int("rows", rows, lo=0)
    return max(rows, 1) * (WS_ROW_STRIDE + 1) + 1


def workspace_rows(ws: torch.Tensor, rows: int) -> torch.Tensor:
    """The per-row part of a workspace for ``rows`` rows, as ``[rows, WS_ROW_STRIDE]``."""
    return ws[: rows * WS_ROW_STRIDE].view(rows, WS_ROW_STRIDE)


def topk_workspace(rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """An int32 workspace for :func:`select_topk` with up to ``rows`` rows (an int >= 0).

    Allocate it once (outside CUDA-graph capture) and pass it as ``workspace=``; the kernels
    restore the part that must be zero on entry, so it can be reused by every later call
    (one call at a time: concurrent calls on one workspace would mix their histograms).
    A tensor of zeros of ``topk_workspace_numel(rows)`` elements serves as well.

    Returns:
        int32 ``[topk_workspace_numel(rows)]`` on ``device``, zero where it must be (the
        histograms); the rest is left uninitialised.
    """
    numel = topk_workspace_numel(rows)
    dev = _runtime.default_device() if device is None else torch.device(device)
    ws = torch.empty(numel, dtype=torch.int32, device=dev)
    workspace_rows(ws, max(rows, 1))[:, :STATE_OFF].zero_()  # the rest needs no content
    return ws


def check_workspace(workspace: torch.Tensor, rows: int) -> None:
    """A workspace given to :func:`select_topk` for ``rows`` rows (ValueError/TypeError)."""
    check_tensor("workspace", workspace, dtype=torch.int32, ndim=1)
    if not workspace.is_contiguous() or workspace.numel() < topk_workspace_numel(rows):
        raise ValueError(
            f"workspace must be a contiguous int32 tensor of at least "
            f"{topk_workspace_numel(rows)} elements, got "
            f"{workspace.numel()} (contiguous={workspace.is_contiguous()})"
        )
    if workspace.data_ptr() % 8:  # the prefilter's per-row counter is an int64
        raise ValueError(
            "workspace must start at an 8-byte aligned address (a view at an odd int32 "
            f"offset is not), got data_ptr() % 8 = {workspace.data_ptr() % 8}"
        )
