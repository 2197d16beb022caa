"""Boolean masks built the same way by every Triton release's compiler and interpreter."""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit


@jit
def mask_and(cond, mask):
    """``cond & mask`` for a bool ``mask`` block and a bool ``cond``, scalar or block.

    Neither ``cond & mask`` (Triton 3.9's interpreter makes an invalid mask dtype of a scalar
    bool and a block) nor ``tl.where(cond, mask, False)`` (Triton 3.3's interpreter cannot
    make a bool constant) runs everywhere; an int32 select compared with 0 does."""
    return tl.where(cond, mask, 0) != 0
