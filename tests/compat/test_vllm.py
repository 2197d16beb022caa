"""sparse_mla.compat.vllm: vLLM's positional order, keywords and assertions, and the entry
points vLLM's DeepSeek-V3.2 path calls, each against our references."""

from __future__ import annotations

import pytest
import torch

import sparse_mla
from sparse_mla.compat import vllm as compat
from sparse_mla.compat.vllm import VllmAssertionError
from sparse_mla.ops.decode_metadata.naive import (
    dcp_local_len,
    expand_decode_tokens_reference,
)
from sparse_mla.ops.remap.naive import (
    convert_req_index_to_global_index_reference as remap_reference,
)
from sparse_mla.ops.topk.naive import select_topk_reference
from sparse_mla.testing import POISON, poison

DEV = sparse_mla._runtime.default_device()


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def f01_case(width: int = 2048):
    ti = torch.full((1, width), -1, dtype=torch.int32, device=DEV)
    ti[0, :2] = i32([5, 70])
    return i32([0]), i32([[3, 4]]), ti


def test_import_sparse_mla_exposes_compat():
    """F13: a plain `import sparse_mla` reaches sparse_mla.compat.vllm."""
    assert sparse_mla.compat.vllm is compat


def test_positional_call_uses_vllms_order():
    """F01: (req_id, bt, ti, 64, 2048) is BLOCK_SIZE=64, NUM_TOPK_TOKENS=2048."""
    out = compat.triton_convert_req_index_to_global_index(*f01_case(), 64, 2048)
    assert out[0, :2].cpu().tolist() == [197, 262]
    assert (out[0, 2:] == -1).all()
    out = compat.triton_convert_req_index_to_global_index(
        *f01_case(), 64, 2048, 128, False, None, None, True
    )
    assert out[1].cpu().tolist() == [2]
    # The page stride is a keyword, as vLLM's callers pass it.
    out = compat.triton_convert_req_index_to_global_index(
        *f01_case(), BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=2048, NUM_TOPK_TOKENS=2048
    )
    assert out[0, :2].cpu().tolist() == [6149, 8198]
    # A positional call meant for (..., BLOCK_SIZE, BLOCK_STRIDE_ROWS, ...) fails loudly.
    with pytest.raises(VllmAssertionError, match="NUM_TOPK_TOKENS"):
        compat.triton_convert_req_index_to_global_index(*f01_case(128), 64, 4096)


def test_dcp_filter_takes_block_stride_rows():
    bt = i32([[10]])
    ti = torch.full((1, 128), -1, dtype=torch.int32, device=DEV)
    ti[0, :8] = torch.arange(8, dtype=torch.int32, device=DEV)
    for stride in (None, 12):
        out, cnt = compat.triton_filter_and_convert_dcp_index(
            i32([0]), bt, ti, 2, 0, 1, 4, 128, return_valid_counts=True, BLOCK_STRIDE_ROWS=stride
        )
        s = stride or 4
        assert cnt.cpu().tolist() == [4]
        assert out[0, :4].cpu().tolist() == [10 * s + 0, 10 * s + 1, 10 * s + 2, 10 * s + 3]
        assert (out[0, 4:] == -1).all()


def test_compat_matches_the_reference():
    g = torch.Generator().manual_seed(31)
    bt = torch.randint(0, 3000, (4, 9), generator=g, dtype=torch.int32).to(DEV)
    idx = torch.randint(-1, 9 * 64 + 40, (10, 256), generator=g, dtype=torch.int32).to(DEV)
    req = torch.randint(0, 4, (10,), generator=g, dtype=torch.int32).to(DEV)
    ws_ids = i32([-1, 0, -1, 1, -1, -1, 0, -1, -1, -1])
    ws_starts = i32([1000, 9000])
    got, cnt = compat.triton_convert_req_index_to_global_index(
        req, bt, idx, 64, 256, 128, True, ws_ids, ws_starts, True
    )
    want, want_cnt = remap_reference(
        req.cpu(), bt.cpu(), idx.cpu(), block_size=64, prefill_request_ids=ws_ids.cpu(),
        prefill_workspace_starts=ws_starts.cpu(), return_valid_counts=True,
    )  # fmt: skip
    assert torch.equal(got.cpu(), want) and torch.equal(cnt.cpu(), want_cnt)
    got = compat.triton_filter_and_convert_dcp_index(req, bt, idx, 2, 1, 16, 64, 256)
    want = remap_reference(
        req.cpu(), bt.cpu(), idx.cpu(), block_size=64, dcp_size=2, dcp_rank=1, interleave=16,
        compact=True,
    )  # fmt: skip
    assert torch.equal(got.cpu(), want)


def test_vllm_assertions_are_assertion_errors():
    """Where vLLM asserts: an AssertionError (and a ValueError) with vLLM's wording."""
    req, bt, ti = f01_case(128)
    conv = compat.triton_convert_req_index_to_global_index
    dcp = compat.triton_filter_and_convert_dcp_index
    cases = [
        (lambda: conv(i32([0, 0]), bt, ti, 64, 128), "must cover the same tokens"),
        (lambda: conv(req.long(), bt, ti, 64, 128), "req_id.dtype == torch.int32"),
        (lambda: conv(req, bt, ti.long(), 64, 128), "token_indices.dtype == torch.int32"),
        (lambda: conv(req, bt, ti, 64, 2048), "token_indices.shape\\[1\\] == NUM_TOPK_TOKENS"),
        (lambda: conv(req, bt, ti, 64, 128, 128, True), "prefill_workspace_request_ids is not"),
        (lambda: dcp(req, bt, ti, 0, 0, 1, 64, 128), "dcp_size >= 1"),
        (lambda: dcp(req, bt, ti, 2, 2, 1, 64, 128), "0 <= dcp_rank < dcp_size"),
        (
            lambda: dcp(req, bt, ti, 2, 0, 3, 64, 128),
            "BLOCK_SIZE \\(64\\) must be divisible by cp_kv_cache_interleave_size \\(3\\)",
        ),
        (lambda: dcp(i32([0, 0]), bt, ti, 2, 0, 1, 64, 128), "must cover the same tokens"),
    ]
    for call, text in cases:
        with pytest.raises(AssertionError, match=text) as info:
            call()
        assert isinstance(info.value, ValueError)


def test_get_dcp_local_seq_lens_shapes():
    lens = i32([[5, 6, 7], [0, 63, 64]])  # vLLM's per-token [B, next_n]
    for rank in (0, 1):
        got = compat.get_dcp_local_seq_lens(lens, 2, rank, 2)
        want = [[dcp_local_len(v, 2, rank, 2) for v in row] for row in lens.cpu().tolist()]
        assert got.shape == (2, 3) and got.cpu().tolist() == want
    every = compat.get_dcp_local_seq_lens(lens[:, 0], 4, None, 1)  # [B, dcp_size]
    assert every.cpu().tolist() == [[2, 1, 1, 1], [0, 0, 0, 0]]
    one_d = compat.get_dcp_local_seq_lens(lens[:, 2].long(), 2, 1)
    assert one_d.dtype == torch.int32 and one_d.cpu().tolist() == [3, 32]


def _topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    return select_topk_reference(scores.cpu(), lengths.cpu(), k=k)


@pytest.mark.parametrize("k", [128, 256, 2048])
def test_top_k_per_row_decode(k):
    g = torch.Generator().manual_seed(k)
    next_n, batch = 2, 3
    n = k + 300
    seq_lens = i32([k + 300, 17, k + 1])
    logits = torch.randn(batch * next_n, n, generator=g).to(DEV)
    out = torch.full((batch * next_n, k), POISON, dtype=torch.int32, device=DEV)
    compat.top_k_per_row_decode(logits, next_n, seq_lens, out, batch * next_n, n, 1, k)
    lens = (seq_lens.cpu()[:, None] - next_n + 1 + torch.arange(next_n)).flatten().int()
    assert torch.equal(out.cpu(), _topk_reference(logits, lens, k))
    # The per-token [B, next_n] lengths give the same rows.
    out2 = torch.full_like(out, POISON)
    compat.top_k_per_row_decode(logits, next_n, lens.view(batch, next_n).to(DEV), out2,
                                batch * next_n, n, 1)  # fmt: skip
    assert torch.equal(out2, out)


def test_top_k_per_row_decode_k3000():
    """vLLM's own top-k tests use k = 3000 (not a multiple of 128)."""
    k, n = 3000, 3500
    logits = torch.randn(2, n).to(DEV)
    lens = i32([n, 2000])
    out = torch.full((2, k), POISON, dtype=torch.int32, device=DEV)
    compat.top_k_per_row_decode(logits, 1, lens, out, 2, n, 1, k)
    assert torch.equal(out.cpu(), _topk_reference(logits, lens, k))


def test_top_k_per_row_prefill_offsets_from_row_starts():
    k, n = 128, 700
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, n, generator=g).to(DEV)
    starts = i32([0, 10, 650, 300])
    ends = i32([600, 700, 700, 250])  # the last one is empty
    out = torch.full((4, k), POISON, dtype=torch.int32, device=DEV)
    compat.top_k_per_row_prefill(logits, starts, ends, out, 4, n, 1, k)
    for r in range(4):
        s, e = int(starts[r]), int(ends[r])
        window = logits[r : r + 1, s:].cpu() if e > s else torch.zeros(1, 1)
        want = _topk_reference(window, torch.tensor([max(e - s, 0)], dtype=torch.int32), k)
        assert torch.equal(out[r].cpu(), want[0]), r
    # Fewer rows than the tensors hold: the rest stays untouched.
    poison(out)
    compat.top_k_per_row_prefill(logits, starts, ends, out, 2, n, 1, k)
    assert (out[2:] == POISON).all() and (out[:2] != POISON).all()


def test_prepare_decode_tensors_paths():
    seq_lens, bt = i32([10, 7, 12]), i32([[1, 2], [3, 4], [5, 6]])
    # Flattened, uniform.
    sl, table, dl, n, pad = compat.prepare_decode_tensors(
        seq_lens, bt, i32([2, 2, 2]), torch.tensor([2, 2, 2]), i32([0, 2, 4]), 3, 6, False, 2, 2
    )
    want = expand_decode_tokens_reference(seq_lens.cpu(), bt.cpu(), 2)
    assert (n, pad) == (6, False)
    assert torch.equal(sl.cpu(), want.seq_lens) and torch.equal(table.cpu(), want.block_table)
    assert dl.cpu().tolist() == [1] * 6
    # Flattened, ragged, with padding rows up to num_decode_tokens.
    sl, table, dl, n, pad = compat.prepare_decode_tensors(
        seq_lens, bt, i32([3, 1, 4]), torch.tensor([3, 1, 4]), i32([0, 3, 4]), 3, 10, False, 4, 4
    )
    want = expand_decode_tokens_reference(seq_lens.cpu(), bt.cpu(), [3, 1, 4], num_tokens=10)
    assert (n, pad) == (10, False)
    assert sl.cpu().tolist() == want.seq_lens.tolist() == [8, 9, 10, 7, 9, 10, 11, 12, 0, 0]
    assert torch.equal(table.cpu(), want.block_table)
    # Native MTP: [B, next_n] lengths; DCP from the global lengths.
    sl, table, dl, n, pad = compat.prepare_decode_tensors(
        seq_lens, bt, i32([2, 2, 1]), torch.tensor([2, 2, 1]), i32([0, 2, 4]), 3, 5, True, 2, 2,
        global_seq_lens=i32([20, 14, 24]), dcp_size=2, dcp_rank=1, cp_kv_cache_interleave_size=1,
    )  # fmt: skip
    assert (n, pad) == (3, True) and table is bt
    assert sl.cpu().tolist() == [[9, 10], [6, 7], [11, 12]]
    # Plain decode: the inputs as they are.
    sl, table, dl, n, pad = compat.prepare_decode_tensors(
        seq_lens, bt, i32([1, 1, 1]), torch.tensor([1, 1, 1]), i32([0, 1, 2]), 3, 3, False, 1, 1
    )
    assert sl is seq_lens and (n, pad) == (3, False)
