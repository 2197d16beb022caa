"""The shared argument checks of ``sparse_mla._checks``: overlap, distinct elements, int32
offsets, and the device rule."""

from __future__ import annotations

import pytest
import torch

from sparse_mla import _checks, _runtime


def test_no_overlap_detects_shared_byte_ranges():
    base = torch.zeros(64, dtype=torch.int32)
    _checks.check_no_overlap("out", base[:32], a=base[32:], b=None, c=torch.zeros(4))
    with pytest.raises(ValueError, match="out overlaps a"):
        _checks.check_no_overlap("out", base[:33], a=base[32:])
    with pytest.raises(ValueError, match="out overlaps b"):
        _checks.check_no_overlap("out", base.view(8, 8)[:, 0], b=base.view(8, 8)[:, 1])
    with pytest.raises(ValueError, match="out overlaps a"):  # other dtype, same bytes
        _checks.check_no_overlap("out", base.view(torch.int8)[5:6], a=base[1:2])
    _checks.check_no_overlap("out", base[:0], a=base)  # empty views touch nothing


def test_distinct_elements():
    _checks.check_distinct_elements("o", torch.zeros(3, 128).t())
    _checks.check_distinct_elements("o", torch.zeros(1, 5).expand(1, 5))
    _checks.check_distinct_elements("o", torch.zeros(10, 10)[::2, 1::3])
    for bad in (
        torch.zeros(1, 128).expand(3, 128),
        torch.zeros(131).as_strided((3, 128), (1, 1)),
        torch.zeros(400).as_strided((3, 128), (100, 1)),
    ):
        with pytest.raises(ValueError, match="o must not be a broadcast view or a view whose"):
            _checks.check_distinct_elements("o", bad)


def test_offsets_fit_int32(huge_int32):
    _checks.check_offsets_fit_int32("o", huge_int32.as_strided((2, 1), (2**31 - 1, 1)))
    _checks.check_offsets_fit_int32("o", huge_int32[2**31 :])  # the offset is in the pointer
    with pytest.raises(ValueError, match="o spans element offsets up to 2147483767"):
        _checks.check_offsets_fit_int32("o", huge_int32.as_strided((1, 128), (1, 16909321)))
    with pytest.raises(ValueError, match="past the int32 range"):
        _checks.check_offsets_fit_int32("o", huge_int32.as_strided((2, 1), (2**31, 1)))


def test_meta_tensors_rejected():
    """F09: a meta tensor has no memory; the device check says so up front."""
    with pytest.raises(ValueError, match="x is on meta"):
        _checks.check_same_device(x=torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="device is on meta"):
        _runtime.canonical_device("meta")


@pytest.mark.skipif(
    not _runtime.INTERPRETER, reason="the interpreter is where meta slipped through"
)
def test_meta_inputs_rejected_by_the_ops():
    """F09: all-meta inputs used to pass the device check under the interpreter."""
    import sparse_mla

    m = dict(dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="is on meta"):
        sparse_mla.convert_req_index_to_global_index(
            torch.zeros(2, **m), torch.zeros(2, 4, **m), torch.zeros(2, 128, **m)
        )
    with pytest.raises(ValueError, match="is on meta"):
        sparse_mla.expand_decode_tokens(
            torch.zeros(2, **m), torch.zeros(2, 4, **m), 1, max_decode_len=1
        )
