"""The shared helpers against their references: DCP and paging at every rank, the e4m3
conversions over every code, the mask helper on scalars and blocks."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

import sparse_mla  # noqa: F401  (decides the interpreter mode)
from sparse_mla._runtime import jit
from sparse_mla.ops._common.dcp import (
    dcp_global,
    dcp_global_reference,
    dcp_local,
    dcp_local_count,
    dcp_local_count_reference,
    dcp_local_reference,
    dcp_owner,
    dcp_owner_reference,
)
from sparse_mla.ops._common.e4m3 import e4m3_bits, e4m3_load_float32
from sparse_mla.ops._common.masks import mask_and
from sparse_mla.ops._common.paging import page_slot, page_slot_reference
from sparse_mla.testing import POISON

DEV = sparse_mla._runtime.default_device()


@jit
def _probe(pos_ptr, page_ptr, out_ptr, n, rank, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr):
    o = tl.arange(0, 128)
    m = o < n
    p = tl.load(pos_ptr + o, mask=m)
    tl.store(out_ptr + o, dcp_owner(p, DCP_SIZE, INTERLEAVE), mask=m)
    tl.store(out_ptr + 128 + o, dcp_local(p, DCP_SIZE, INTERLEAVE), mask=m)
    tl.store(out_ptr + 256 + o, dcp_global(p, rank, DCP_SIZE, INTERLEAVE), mask=m)
    tl.store(out_ptr + 384 + o, dcp_local_count(p, rank, DCP_SIZE, INTERLEAVE), mask=m)
    slot, _ = page_slot(tl.load(page_ptr + o, mask=m), p % 64, 64)
    tl.store(out_ptr + 512 + o, slot, mask=m)


@pytest.mark.parametrize("dcp_size,interleave", [(1, 1), (2, 1), (2, 2), (3, 4), (4, 64)])
def test_dcp_and_paging_match_references(dcp_size: int, interleave: int) -> None:
    pos = torch.arange(100, dtype=torch.int32)
    pages = torch.randint(-3, 2**26, (100,), dtype=torch.int32)
    pages[:4] = torch.tensor([-1, 2**25 - 1, 2**25, 0])  # padding, last fitting, first wrapping
    for rank in range(dcp_size):
        out = torch.full((640,), POISON, dtype=torch.int32, device=DEV)
        _probe[(1,)](pos.to(DEV), pages.to(DEV), out, 100, rank, dcp_size, interleave)
        out = out.cpu()
        local = dcp_local_reference(pos, dcp_size, interleave)
        own = dcp_owner_reference(pos, dcp_size, interleave) == rank
        assert torch.equal(out[:100], dcp_owner_reference(pos, dcp_size, interleave))
        assert torch.equal(out[128:228], local)
        assert torch.equal(out[256:356], dcp_global_reference(pos, rank, dcp_size, interleave))
        assert torch.equal(dcp_global_reference(local[own], rank, dcp_size, interleave), pos[own])
        counts = dcp_local_count_reference(pos, rank, dcp_size, interleave)
        assert torch.equal(out[384:484], counts)
        slot, ok = page_slot_reference(pages, pos % 64, 64)
        assert torch.equal(out[512:612], slot)
        assert not ok[0] and ok[1] and not ok[2]


def test_spec_examples() -> None:
    p = torch.tensor([5])
    assert dcp_owner_reference(p, 2, 1).item() == 1 and dcp_local_reference(p, 2, 1).item() == 2
    assert dcp_owner_reference(p, 2, 2).item() == 0 and dcp_local_reference(p, 2, 2).item() == 3
    lens = torch.tensor([8, 9, 10])
    assert dcp_local_count_reference(lens, 1, 2, 1).tolist() == [4, 4, 5]


@jit
def _e4m3_probe(code_ptr, out_ptr, back_ptr, E4M3_BITS: tl.constexpr):
    o = tl.arange(0, 256)
    x = e4m3_load_float32(tl.load(code_ptr + o), E4M3_BITS)
    tl.store(out_ptr + o, x)
    tl.store(back_ptr + o, e4m3_bits(x))


@pytest.mark.parametrize("bits", [True, False], ids=["bits", "triton"])
def test_e4m3_decode_every_code_bit_exact(bits: bool) -> None:
    """Every float8_e4m3fn byte decodes to PyTorch's fp32, bit for bit (NaN included, on
    the bits path: Triton 3.9's interpreter reads 0x7F / 0xFF as +-480, a GPU as NaN), and
    the writers' encoder gives the byte back (NaN as the one canonical 0x7F)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    out = torch.full((256,), POISON, dtype=torch.int32, device=DEV)
    back = torch.full((256,), 0xA7, dtype=torch.uint8, device=DEV)
    _e4m3_probe[(1,)](codes.to(DEV), out.view(torch.float32), back, bits)
    got = out.cpu()
    nan = want.isnan()
    assert nan.sum() == 2  # 0x7F and 0xFF
    seen = ~nan if not bits and DEV.type != "cuda" else torch.ones(256, dtype=torch.bool)
    bad = (got != want.view(torch.int32)) & seen
    assert not bad.any(), bad.nonzero().flatten().tolist()
    assert torch.equal(back.cpu()[seen], torch.where(nan, 0x7F, codes.int()).to(torch.uint8)[seen])


@jit
def _mask_probe(out_ptr, flag, SCALAR: tl.constexpr):
    o = tl.arange(0, 16)
    cond = flag != 0 if SCALAR else (o % 3) == flag
    tl.store(out_ptr + o, mask_and(cond, o < 9).to(tl.int32))


@pytest.mark.parametrize("scalar", [True, False])
@pytest.mark.parametrize("flag", [0, 1])
def test_mask_and(scalar: bool, flag: int) -> None:
    out = torch.full((16,), POISON, dtype=torch.int32, device=DEV)
    _mask_probe[(1,)](out, flag, scalar)
    o = torch.arange(16)
    cond = torch.tensor(flag != 0) if scalar else (o % 3) == flag
    assert torch.equal(out.cpu(), (cond & (o < 9)).int())
