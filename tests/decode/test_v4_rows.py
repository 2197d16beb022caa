"""The V4 step's per-row kernels (``decode/v4_rows.py``) against their references: the
metadata bit for bit (random ragged batches, and hostile offsets, lengths and tables), the
inverse RoPE within one bf16 rounding of the float64 rotation, both on poisoned buffers."""

from __future__ import annotations

import pytest
import torch

from sparse_mla._runtime import default_device
from sparse_mla.decode.v4_naive import inverse_rope, row_metadata_reference, row_positions
from sparse_mla.decode.v4_rows import inverse_rope_, v4_row_metadata
from sparse_mla.testing import poison

DEV = default_device()
I32 = torch.int32


def _metadata(qsl, seq, table, rows, *, page, window, rate):
    """The kernel's outputs on poisoned buffers, and the reference's."""
    bufs = dict(req=torch.empty(rows, dtype=I32, device=DEV),
                pos=torch.empty(rows, dtype=I32, device=DEV),
                visible=torch.empty(rows, dtype=I32, device=DEV),
                win_pos=torch.empty(rows, window, dtype=I32, device=DEV),
                slot=torch.empty(rows, dtype=torch.int64, device=DEV))  # fmt: skip
    poison(*bufs.values())
    v4_row_metadata(qsl, seq, table, page=page, window=window, compress_rate=rate, **bufs)
    ref = row_metadata_reference(qsl, seq, table, num_rows=rows, page=page, window=window,
                                 compress_rate=rate)  # fmt: skip
    return tuple(bufs.values()), ref


def _assert_equal(got, ref):
    for name, g, r in zip(("req", "pos", "visible", "win_pos", "slot"), got, ref, strict=True):
        assert g.dtype == r.dtype and torch.equal(g, r), name


def _random_batch(gen, b, *, page, cols, pad):
    lens = torch.randint(0, 4, (b,), generator=gen)
    seq = (lens + torch.randint(0, page * cols, (b,), generator=gen)).to(I32)
    q0 = int(torch.randint(0, 50, (1,), generator=gen))  # offsets need not start at 0
    qsl = torch.tensor([q0, *(q0 + lens.cumsum(0)).tolist()], dtype=I32)
    table = torch.randperm(b * cols + 7, generator=gen)[: b * cols].view(b, cols).to(I32)
    return qsl.to(DEV), seq.to(DEV), table.to(DEV), int(lens.sum()) + pad


@pytest.mark.parametrize("b", [1, 5, 70])  # 70: more requests than one compare block
@pytest.mark.parametrize("window,rate", [(8, 4), (1, 128), (13, 1)])
def test_metadata_random(b, window, rate):
    gen = torch.Generator().manual_seed(b * 100 + window)
    qsl, seq, table, rows = _random_batch(gen, b, page=4, cols=6, pad=3)
    got, ref = _metadata(qsl, seq, table, rows, page=4, window=window, rate=rate)
    _assert_equal(got, ref)
    req, pos = row_positions(seq, qsl, rows)  # the step reference's own rule
    assert torch.equal(got[1].long(), pos)
    valid = pos >= 0
    assert torch.equal(got[0].long()[valid], req[valid])
    assert (got[0][rows - 3 :] == b).all() and (got[1][rows - 3 :] == -1).all()  # padding


def test_metadata_hostile():
    """Negative positions (seq_lens < n_b), lengths near int32's end, non-monotone and
    negative offsets, -1 and past-the-table pages, strided inputs."""
    page, cols = 4, 3
    qsl = torch.tensor([5, 7, 6, 9, 9, 12], dtype=I32, device=DEV)  # 7 > 6: not monotone
    seq = torch.tensor([1, 2**31 - 1, 40, 3, 2**31 - 2], dtype=I32, device=DEV)
    table = torch.tensor([[3, -1, 2], [0, 1, 4], [5, 6, 7], [-1, -1, -1], [1, 2, 3]],
                         dtype=I32, device=DEV)  # fmt: skip
    for window, rate in ((5, 4), (1, 1)):
        got, ref = _metadata(qsl, seq, table, 12, page=page, window=window, rate=rate)
        _assert_equal(got, ref)
    # strided views of the same values
    qsl2 = torch.stack([qsl, qsl], 1)[:, 0]
    seq2 = torch.stack([seq, seq], 1)[:, 1]
    table2 = torch.cat([table, table], 1)[:, ::2][:, :cols]
    assert not (qsl2.is_contiguous() or seq2.is_contiguous() or table2.is_contiguous())
    got2, _ = _metadata(qsl2, seq2, table2, 12, page=page, window=5, rate=4)
    _, ref = _metadata(qsl, seq, table2.contiguous(), 12, page=page, window=5, rate=4)
    _assert_equal(got2, ref)
    # every offset negative (rows count from qsl[0]); rows 0-1 at positions -2 and -1
    qsl3 = torch.tensor([-20, -18, -18], dtype=I32, device=DEV)
    seq3 = torch.tensor([0, 5], dtype=I32, device=DEV)
    got, ref = _metadata(qsl3, seq3, table[:2], 4, page=page, window=3, rate=4)
    _assert_equal(got, ref)
    assert got[1].tolist() == [-1, -1, -1, -1]  # then padding
    # an end offset that wraps int32: the positions (int64) leave int32, so no position
    qsl4 = torch.tensor([0, 10, -(2**31), 20], dtype=I32, device=DEV)
    seq4 = torch.tensor([3, 2**31 - 1, 3], dtype=I32, device=DEV)
    got, ref = _metadata(qsl4, seq4, table[:3], 8, page=page, window=3, rate=4)
    _assert_equal(got, ref)
    assert got[1].tolist() == [-1] * 8 and got[4].tolist() == [-1] * 8


def test_metadata_checks():
    z = torch.zeros(4, dtype=I32, device=DEV)
    bufs = dict(req=z.clone(), pos=z.clone(), visible=z.clone(),
                win_pos=torch.zeros(4, 2, dtype=I32, device=DEV),
                slot=torch.zeros(4, dtype=torch.int64, device=DEV))  # fmt: skip
    qsl, seq = torch.tensor([0, 4], dtype=I32, device=DEV), z[:1].clone()
    table = torch.zeros(1, 2, dtype=I32, device=DEV)
    kw = dict(page=4, window=2, compress_rate=4)
    with pytest.raises(ValueError, match="query_start_loc"):
        v4_row_metadata(qsl[:1], seq, table, **kw, **bufs)
    with pytest.raises(TypeError, match="seq_lens"):
        v4_row_metadata(qsl, seq.long(), table, **kw, **bufs)
    with pytest.raises(ValueError, match="window_block_table"):
        v4_row_metadata(qsl, seq, table[:0], **kw, **bufs)
    with pytest.raises(ValueError, match="window_block_table"):
        v4_row_metadata(qsl, seq, table[:, :0], **kw, **bufs)
    with pytest.raises(ValueError, match="seq_lens"):
        v4_row_metadata(qsl, seq[0], table, **kw, **bufs)
    with pytest.raises(ValueError, match="win_pos"):
        v4_row_metadata(qsl, seq, table, **(kw | {"window": 3}), **bufs)
    with pytest.raises(TypeError, match="slot"):
        v4_row_metadata(qsl, seq, table, **kw, **(bufs | {"slot": z.clone()}))
    with pytest.raises(ValueError, match="page"):
        v4_row_metadata(qsl, seq, table, **(kw | {"page": 0}), **bufs)
    with pytest.raises(ValueError, match="req overlaps pos"):
        v4_row_metadata(qsl, seq, table, **kw, **(bufs | {"pos": bufs["req"]}))
    both = torch.zeros(4, dtype=I32, device=DEV)  # seq_lens is visible's last element
    with pytest.raises(ValueError, match="visible overlaps seq_lens"):
        v4_row_metadata(qsl, both[3:], table, **kw, **(bufs | {"visible": both}))


def _rope_case(gen, t, heads, d, positions, dtype):
    out = (torch.randn(t, heads, d, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    inv = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
    ang = torch.arange(positions).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).to(dtype).to(DEV)
    return out, cos_sin


def _assert_rope_close(got, before, cos_sin, pos):
    ref = inverse_rope(before.double(), cos_sin, pos.long().clamp(max=cos_sin.shape[0] - 1))
    # one bf16 rounding of the fp32 result, which is within fp32 rounding of ref
    tol = 2.0**-8 * ref.abs() + 2.0**-20 * before.double().abs().amax()
    assert ((got.double() - ref).abs() <= tol).all()
    assert torch.equal(got[..., :-64], before[..., :-64])  # the other dims untouched


@pytest.mark.parametrize("heads", [1, 3, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_rope(heads, dtype):
    gen = torch.Generator().manual_seed(heads)
    out, cos_sin = _rope_case(gen, 5, heads, 512, 40, dtype)
    pos = torch.tensor([0, 7, -1, 39, 1000], dtype=I32, device=DEV)  # -1: row 0; 1000: row 39
    before = out.clone()
    assert inverse_rope_(out, cos_sin, pos) is out
    _assert_rope_close(out, before, cos_sin, pos)
    # the rotation by -p undoes one by +p: rotating back with -sin gives the input
    back = torch.cat([cos_sin[:, :32], -cos_sin[:, 32:]], 1)
    again = inverse_rope_(out.clone(), back, pos)
    assert (again.float() - before.float()).abs().max() <= 2.0**-6 * before.float().abs().max()


def test_inverse_rope_strided_and_checks():
    gen = torch.Generator().manual_seed(3)
    full, cos_sin = _rope_case(gen, 4, 6, 512, 16, torch.float32)
    out = full[:, ::2]  # heads strided
    pos = torch.tensor([[3, 1], [0, 1], [15, 1], [8, 1]], dtype=I32, device=DEV)[:, 0]
    before, other = out.clone(), full[:, 1::2].clone()
    inverse_rope_(out, cos_sin, pos)
    _assert_rope_close(out, before, cos_sin, pos)
    assert torch.equal(full[:, 1::2], other)  # the skipped heads untouched
    with pytest.raises(TypeError, match="out"):
        inverse_rope_(out.float(), cos_sin, pos)
    with pytest.raises(ValueError, match="cos_sin"):
        inverse_rope_(out, cos_sin[:, :32], pos)
    with pytest.raises(ValueError, match="pos"):
        inverse_rope_(out, cos_sin, pos[:2])
    with pytest.raises(ValueError, match="rope_dim"):
        inverse_rope_(out, cos_sin, pos, rope_dim=48)
    flat = torch.zeros(4 * 6 * 512 + 4, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="out overlaps pos"):
        inverse_rope_(flat[:-4].view(4, 6, 512), cos_sin, flat.view(torch.int32)[-4:])
