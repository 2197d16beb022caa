"""float8_e4m3fn <-> fp32 on the integer bits, identical on every backend and target.

Triton cannot emit ``tl.float8e4nv`` (types, pointers or conversions) for NVIDIA GPUs before
sm_89, and its 3.9 interpreter rounds fp32 -> e4m3 wrongly and reads the NaN bytes as +-480.
The writers always encode here; readers decode here where the target has no native e4m3
(``E4M3_BITS``, decided by ``sparse_mla._runtime.e4m3_native``) and keep the hardware
conversion (and fp8 MMA) elsewhere. ``tests/ops/test_common.py`` checks both directions
bit for bit against PyTorch's conversions.
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit


@jit
def e4m3_to_float32(raw):
    """float8_e4m3fn bytes (any integer type, low 8 bits used) -> fp32, exactly as PyTorch
    converts them (0x7F / 0xFF are NaN; 0x80 is -0.0). Normals are rebuilt in the fp32 bits
    (exponent rebiased 7 -> 127); subnormals ``m * 2**-9`` come from an exact int -> float
    conversion and a power-of-two product, so no denormal flushing can touch them."""
    b = raw.to(tl.int32) & 0xFF
    mag = b & 0x7F
    e = mag >> 3
    m = mag & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2**-9
    bits = tl.where(e == 0, sub, normal)
    bits = tl.where(mag == 0x7F, 0x7FF00000, bits) | ((b & 0x80) << 24)  # NaN as PyTorch: m << 20
    return bits.to(tl.float32, bitcast=True)


@jit
def e4m3_load_float32(raw, E4M3_BITS: tl.constexpr):
    """Bytes of float8_e4m3fn values (a uint8 block) as fp32: on the bits where the target
    has no e4m3 (``E4M3_BITS``), else by Triton's conversion."""
    if E4M3_BITS:
        x = e4m3_to_float32(raw)
    else:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return x


@jit
def e4m3_bits(y):
    """fp32 -> float8_e4m3fn bit pattern (uint8), round to nearest even; magnitudes past 448
    (inf included) saturate to +-448, as PyTorch's clamp-then-convert does, and every NaN
    becomes 0x7F.

    Integer arithmetic instead of ``.to(tl.float8e4nv)``: Triton 3.9's interpreter rounds that
    conversion wrongly (no carry into the exponent, subnormals truncated), and Triton cannot
    emit it before sm_89; this gives the same bits as PyTorch's conversion on every backend.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    # Normal range (|y| >= 2**-6): round the 23-bit mantissa to 3 bits; the carry of the
    # rounding add propagates into the exponent by itself. Rebias 127 -> 7.
    rn = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rn >> 20) - ((127 - 7) << 3)
    # Subnormal range: units of 2**-9; shift the 24-bit significand right with RNE.
    e = (mag >> 23) - 127
    sig = (mag & 0x7FFFFF) | 0x800000
    sh = tl.minimum(14 - e, 31)
    sh = tl.maximum(sh, 1)
    q = sig >> sh
    rem = sig - (q << sh)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    code = tl.where(e >= -6, normal, sub)
    code = tl.where(mag > 0x43E00000, 0x7E, code) | sign  # past 448.0 (inf too): saturate
    # NaN: the one canonical e4m3 NaN (GPUs do not keep a NaN's sign through arithmetic).
    return tl.where(mag > 0x7F800000, 0x7F, code).to(tl.uint8)
