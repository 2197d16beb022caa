"""Decode-metadata expansion: kernels vs the loop reference, bit for bit (Triton interpreter)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparse_mla
from sparse_mla._runtime import default_device
from sparse_mla.ops.decode_metadata import (
    DecodeMetadataBuilder,
    ExpandConfig,
    ExpandedDecodeTokens,
    dcp_local_seq_lens,
    expand_decode_tokens,
    native_decode_seq_lens,
)
from sparse_mla.ops.decode_metadata import expand as expand_mod
from sparse_mla.ops.decode_metadata.naive import (
    dcp_local_len,
    dcp_local_seq_lens_reference,
    expand_decode_tokens_reference,
    expand_decode_tokens_torch_ops,
    native_decode_seq_lens_reference,
)
from sparse_mla.testing import (
    BLOCK_TABLE_LAYOUTS,
    POISON,
    expansion_decode_lens,
    expansion_inputs,
)

DEV = default_device()


def i32(values, *shape: int) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int32, device=DEV)
    return t.reshape(shape) if shape else t


def poisoned_out(num_tokens: int, width: int, rng: random.Random) -> ExpandedDecodeTokens:
    """Output buffers full of POISON; the block table is sometimes a strided view."""

    def vec() -> torch.Tensor:
        return torch.full((num_tokens,), POISON, dtype=torch.int32, device=DEV)

    pad = 5 if rng.random() < 0.5 else 0
    bt = torch.full((num_tokens, width + pad), POISON, dtype=torch.int32, device=DEV)
    return ExpandedDecodeTokens(vec(), bt[:, :width], vec(), vec())


def assert_same(got: ExpandedDecodeTokens, want: ExpandedDecodeTokens, msg: str) -> None:
    for name in ExpandedDecodeTokens._fields:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.int32, f"{name} dtype {g.dtype} ({msg})"
        assert g.shape == w.shape, f"{name} shape {tuple(g.shape)} != {tuple(w.shape)} ({msg})"
        assert torch.equal(g, w), f"{name} differs ({msg}):\n{g}\nwant\n{w}"
        assert not (g == POISON).any(), f"{name} has unwritten entries ({msg})"


# ----------------------------------------------------------------------------------------------
# Worked examples (SPEC section 1 and 3)
# ----------------------------------------------------------------------------------------------


def test_exports() -> None:
    assert sparse_mla.expand_decode_tokens is expand_decode_tokens
    assert sparse_mla.dcp_local_seq_lens is dcp_local_seq_lens


@pytest.mark.parametrize("form", ["int", "list", "list_forced_ragged", "device_tensor"])
def test_uniform_example(form: str) -> None:
    seq_lens = i32([10, 7])
    bt = i32([[1, 2, 3], [4, 5, 6]], 2, 3)
    kwargs: dict = {"max_decode_len": 3}
    dl: object = {"int": 3, "list": [3, 3], "list_forced_ragged": [3, 3]}.get(form)
    if form == "list_forced_ragged":
        kwargs["uniform"] = False
    if form == "device_tensor":
        dl = i32([3, 3])
        kwargs["num_tokens"] = 6
    out = expand_decode_tokens(seq_lens, bt, dl, **kwargs)
    assert out.seq_lens.tolist() == [8, 9, 10, 5, 6, 7]
    assert out.req_id.tolist() == [0, 0, 0, 1, 1, 1]
    assert out.decode_lens.tolist() == [1] * 6
    assert out.block_table.tolist() == [[1, 2, 3]] * 3 + [[4, 5, 6]] * 3


@pytest.mark.parametrize("form", ["host", "device", "query_start_loc"])
def test_ragged_example(form: str) -> None:
    seq_lens = i32([10, 7, 12, 0])
    bt = i32(list(range(8)), 4, 2)
    if form == "query_start_loc":  # offsets of a larger batch: these requests start at 5
        kw = {"query_start_loc": i32([5, 8, 9, 13, 13])}
    else:
        kw = {"decode_lens": i32([3, 1, 4, 0]) if form == "device" else [3, 1, 4, 0]}
    out = expand_decode_tokens(seq_lens, bt, max_decode_len=4, num_tokens=10, **kw)
    assert out.seq_lens.tolist() == [8, 9, 10, 7, 9, 10, 11, 12, 0, 0]
    assert out.req_id.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 0, 0]
    assert out.block_table.tolist() == [[0, 1]] * 3 + [[2, 3]] + [[4, 5]] * 4 + [[0, 0]] * 2
    assert out.decode_lens.tolist() == [1] * 10


def test_rows_cut_at_num_tokens() -> None:
    # Fewer rows than tokens (device data): request 1 loses its last token, not its lengths.
    seq_lens, bt = i32([10, 7]), i32([[1], [2]], 2, 1)
    for kw in ({"decode_lens": i32([2, 2])}, {"query_start_loc": i32([5, 7, 9])}):
        out = expand_decode_tokens(seq_lens, bt, max_decode_len=2, num_tokens=3, **kw)
        assert out.seq_lens.tolist() == [9, 10, 6], kw
        assert out.req_id.tolist() == [0, 0, 1] and out.block_table.tolist() == [[1], [1], [2]]


def test_default_num_tokens() -> None:
    seq_lens, bt = i32([10, 7, 12, 0]), i32(list(range(8)), 4, 2)
    assert expand_decode_tokens(seq_lens, bt, [3, 1, 4, 0], max_decode_len=4).seq_lens.shape == (8,)
    # Device data is not host-known: one row per possible token.
    out = expand_decode_tokens(seq_lens, bt, i32([3, 1, 4, 0]), max_decode_len=5)
    assert out.seq_lens.tolist() == [8, 9, 10, 7, 9, 10, 11, 12] + [0] * 12


def test_dcp_examples() -> None:
    # World 2, rank 1: global [8, 9, 10] -> local [4, 4, 5] (localised after expansion).
    got = dcp_local_seq_lens(i32([8, 9, 10]), dcp_size=2, dcp_rank=1)
    assert got.tolist() == [4, 4, 5]
    out = expand_decode_tokens(
        i32([10]), i32([[3]], 1, 1), 3, max_decode_len=3, dcp_size=2, dcp_rank=1
    )
    assert out.seq_lens.tolist() == [4, 4, 5]
    # Owner examples: W=2, I=1: p=5 on rank 1; W=2, I=2: p=5 on rank 0.
    assert dcp_local_len(6, 2, 1, 1) - dcp_local_len(5, 2, 1, 1) == 1
    assert dcp_local_len(6, 2, 0, 2) - dcp_local_len(5, 2, 0, 2) == 1
    native = native_decode_seq_lens(i32([10]), next_n=3, dcp_size=2, dcp_rank=1)
    assert native.tolist() == [[4, 4, 5]]


def test_native_example() -> None:
    got = native_decode_seq_lens(i32([10, 7, 1]), next_n=3)
    assert got.tolist() == [[8, 9, 10], [5, 6, 7], [0, 0, 1]]


# ----------------------------------------------------------------------------------------------
# Randomised comparisons against the references
# ----------------------------------------------------------------------------------------------

LAYOUTS = list(BLOCK_TABLE_LAYOUTS)
DCP_CONFIGS = [(1, 1), (2, 1), (2, 16), (4, 1), (4, 16), (4, 64), (2, 64)]


# Block-table columns per program of the expansion kernel: the default sizes, and 16
# (several programs per request at the widths tested).
COPY_CHUNKS = [None, 16]


def copy_chunk_config(chunk: int | None) -> ExpandConfig | None:
    """The expansion's config for this copy chunk (None: the defaults)."""
    return None if chunk is None else ExpandConfig(min_copy_chunk=chunk, max_copy_chunk=chunk)


def as_query_start_loc(host: list[int], rng: random.Random) -> torch.Tensor:
    """``host`` as cumulative offsets from a random first offset, sometimes a strided view."""
    offs = [rng.choice([0, rng.randint(1, 1000)])]
    for n in host:
        offs.append(offs[-1] + n)
    if rng.random() < 0.5:
        return i32(offs)
    big = torch.full((2 * len(offs),), POISON, dtype=torch.int32, device=DEV)
    big[::2] = i32(offs)
    return big[::2]


@pytest.mark.parametrize(
    "mode", ["uniform", "ragged_host", "ragged_device", "forced_ragged", "query_start_loc"]
)
@pytest.mark.parametrize("case", range(len(COPY_CHUNKS)))
def test_expand_random(mode: str, case: int, rng: random.Random, seed: int) -> None:
    chunk = COPY_CHUNKS[case % len(COPY_CHUNKS)]
    config = copy_chunk_config(chunk)
    for trial in range(4):
        num_reqs = rng.choice([0, 1, 2, 3, 5, 7])
        width = rng.choice([0, 1, 3, 17, 64]) if trial < 3 else 1030  # > one copy chunk
        max_n = rng.randint(1, 5)
        kind = "uniform" if mode == "uniform" else "ragged"
        uniform_n = rng.randint(0, max_n)
        host = expansion_decode_lens(None, num_reqs, max_n, kind, decode_len=uniform_n)
        decode_lens: object = uniform_n if mode == "uniform" else host
        # Lengths around n: 0, below n (clamped), and large ones that DCP splits unevenly.
        x = expansion_inputs(
            None, host, width=width, max_decode_len=max_n, seq_lens="near_decode_len",
            ctx=600, page_ids=1 << 20, layout=rng.choice(LAYOUTS), device=DEV,
        )  # fmt: skip
        seq_lens, bt = x.seq_lens, x.block_table
        dcp_size, interleave = rng.choice(DCP_CONFIGS)
        dcp_rank = rng.randrange(dcp_size)
        total = sum(host)
        num_tokens = total + rng.choice([0, 0, 1, 4])
        ref_kw = dict(
            num_tokens=num_tokens, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave
        )
        kwargs: dict = {"max_decode_len": max_n, **ref_kw}
        if mode == "ragged_device":
            decode_lens = i32(host)
        if mode == "forced_ragged":
            kwargs["uniform"] = False
        if mode == "query_start_loc":
            kwargs["query_start_loc"] = as_query_start_loc(host, rng)
            decode_lens = None
        msg = (
            f"seed={seed} trial={trial} B={num_reqs} W={width} n={host} L={seq_lens.tolist()} "
            f"N={num_tokens} dcp=({dcp_size},{dcp_rank},{interleave}) chunk={chunk}"
        )
        want = expand_decode_tokens_reference(seq_lens, bt, host, **ref_kw)
        out = poisoned_out(num_tokens, width, rng) if rng.random() < 0.7 else None
        got = expand_decode_tokens(seq_lens, bt, decode_lens, out=out, config=config, **kwargs)
        if out is not None:
            assert got is out
        assert_same(got, want, msg)
        # The PyTorch-ops baseline agrees too.
        ops = expand_decode_tokens_torch_ops(seq_lens, bt, host, **ref_kw)
        assert_same(ops, want, "torch_ops " + msg)


def test_torch_ops_device_lens(rng: random.Random, seed: int) -> None:
    host = expansion_decode_lens(None, 6, 4, "ragged")
    x = expansion_inputs(None, host, width=9, seq_lens="near_decode_len", ctx=50, device=DEV)
    seq_lens, bt = x.seq_lens, x.block_table
    want = expand_decode_tokens_reference(seq_lens, bt, host, num_tokens=sum(host) + 3)
    got = expand_decode_tokens_torch_ops(
        seq_lens, bt, i32(host), total_tokens=sum(host), num_tokens=sum(host) + 3
    )
    assert_same(got, want, f"seed={seed}")
    with pytest.raises(ValueError, match="total_tokens"):
        expand_decode_tokens_torch_ops(seq_lens, bt, i32(host))


@pytest.mark.parametrize("case", range(4))
def test_device_decode_lens_adversarial(case: int, rng: random.Random, seed: int) -> None:
    """Hostile device lengths: negative, above max_decode_len, sum beyond num_tokens."""
    config = copy_chunk_config(COPY_CHUNKS[case % len(COPY_CHUNKS)])
    max_n = 3
    for trial in range(3):
        num_reqs = rng.randint(1, 6)
        host = expansion_decode_lens(None, num_reqs, max_n, "hostile")
        x = expansion_inputs(
            None, host, width=rng.choice([1, 5, 40]), max_decode_len=max_n, seq_lens="hostile",
            page_ids=1 << 20, layout=rng.choice(LAYOUTS), device=DEV,
        )  # fmt: skip
        seq_lens, bt, clamped_total = x.seq_lens, x.block_table, x.total
        num_tokens = rng.randint(0, clamped_total + 2)
        dcp_size, interleave = rng.choice(DCP_CONFIGS)
        dcp_rank = rng.randrange(dcp_size)
        dcp = {"dcp_size": dcp_size, "dcp_rank": dcp_rank, "interleave": interleave}
        want = expand_decode_tokens_reference(
            seq_lens, bt, host, max_decode_len=max_n, num_tokens=num_tokens, **dcp
        )
        out = poisoned_out(num_tokens, bt.shape[1], rng)
        got = expand_decode_tokens(
            seq_lens,
            bt,
            i32(host),
            max_decode_len=max_n,
            num_tokens=num_tokens,
            out=out,
            config=config,
            **dcp,
        )
        assert_same(got, want, f"seed={seed} trial={trial} n={host} L={seq_lens.tolist()}")


@pytest.mark.parametrize("case", range(4))
def test_native_random(case: int, rng: random.Random, seed: int) -> None:
    for trial in range(3):
        num_reqs = rng.choice([0, 1, 4, 9])
        next_n = rng.randint(1, 5)
        # Lengths 0, 1, around next_n and up to 300 (or negative and int32 extremes).
        seq_lens = expansion_inputs(
            None, [next_n] * num_reqs, width=0, seq_lens=rng.choice(["near_decode_len", "hostile"]),
            ctx=300, device=DEV,
        ).seq_lens  # fmt: skip
        dcp_size, interleave = rng.choice(DCP_CONFIGS)
        dcp = {
            "dcp_size": dcp_size,
            "dcp_rank": rng.randrange(dcp_size),
            "interleave": interleave,
        }
        want = native_decode_seq_lens_reference(seq_lens, next_n=next_n, **dcp)
        if rng.random() < 0.5:
            # Column-major, poisoned buffer.
            out = torch.full((next_n, num_reqs), POISON, dtype=torch.int32, device=DEV).t()
        else:
            out = torch.full((num_reqs, next_n), POISON, dtype=torch.int32, device=DEV)
        got = native_decode_seq_lens(seq_lens, next_n=next_n, out=out, **dcp)
        assert got is out
        assert torch.equal(got, want), f"seed={seed} trial={trial} {dcp}\n{got}\n{want}"


@pytest.mark.parametrize("dcp_size,interleave", [(1, 1), (2, 1), (2, 16), (4, 1), (4, 16), (4, 64)])
def test_dcp_local_random(dcp_size: int, interleave: int, rng: random.Random, seed: int) -> None:
    n = rng.randint(1, 40)
    lens = [rng.choice([-9, 0, 1, rng.randint(0, 700)]) for _ in range(n)]
    for rank in range(dcp_size):
        # Definition: count the owned positions one by one.
        brute = [
            sum(1 for p in range(max(v, 0)) if (p // interleave) % dcp_size == rank) for v in lens
        ]
        assert [dcp_local_len(v, dcp_size, rank, interleave) for v in lens] == brute
        ref = dcp_local_seq_lens_reference(
            i32(lens), dcp_size=dcp_size, dcp_rank=rank, interleave=interleave
        )
        assert ref.tolist() == brute, f"seed={seed}"
        # Strided input, poisoned output.
        src = torch.full((2 * n,), POISON, dtype=torch.int32, device=DEV)
        src[::2] = i32(lens)
        out = torch.full((n,), POISON, dtype=torch.int32, device=DEV)
        got = dcp_local_seq_lens(
            src[::2], dcp_size=dcp_size, dcp_rank=rank, interleave=interleave, out=out
        )
        assert got is out and got.tolist() == brute, f"seed={seed} rank={rank}"
    # Every position is owned by exactly one rank.
    per_rank = [
        dcp_local_seq_lens(i32(lens), dcp_size=dcp_size, dcp_rank=r, interleave=interleave)
        for r in range(dcp_size)
    ]
    assert torch.stack(per_rank).sum(0).tolist() == [max(v, 0) for v in lens]


def test_dcp_local_in_place_and_empty() -> None:
    t = i32([8, 9, 10])
    assert dcp_local_seq_lens(t, dcp_size=2, dcp_rank=1, out=t) is t
    assert t.tolist() == [4, 4, 5]
    assert dcp_local_seq_lens(i32([]), dcp_size=2, dcp_rank=0).shape == (0,)


# ----------------------------------------------------------------------------------------------
# Edge cases
# ----------------------------------------------------------------------------------------------


def test_empty_batch() -> None:
    bt = torch.empty((0, 4), dtype=torch.int32, device=DEV)
    seq_lens = i32([])
    out = expand_decode_tokens(seq_lens, bt, [], max_decode_len=2)
    assert [t.shape for t in out] == [(0,), (0, 4), (0,), (0,)]
    # All padding.
    for dl, kw in (([], {}), (2, {}), (i32([]), {}), ([], {"uniform": False})):
        out = expand_decode_tokens(seq_lens, bt, dl, max_decode_len=2, num_tokens=3, **kw)
        assert out.seq_lens.tolist() == [0, 0, 0]
        assert out.req_id.tolist() == [0, 0, 0]
        assert out.decode_lens.tolist() == [1, 1, 1]
        assert out.block_table.tolist() == [[0] * 4] * 3
    assert native_decode_seq_lens(seq_lens, next_n=2).shape == (0, 2)


def test_zero_tokens_and_zero_width() -> None:
    seq_lens, bt = i32([5, 6]), i32([[1, 2], [3, 4]], 2, 2)
    out = expand_decode_tokens(seq_lens, bt, 0, max_decode_len=2)
    assert out.seq_lens.shape == (0,) and out.block_table.shape == (0, 2)
    out = expand_decode_tokens(seq_lens, bt, i32([1, 1]), max_decode_len=2, num_tokens=0)
    assert out.seq_lens.shape == (0,)
    out = expand_decode_tokens(seq_lens, bt, 0, max_decode_len=2, num_tokens=2)
    assert out.seq_lens.tolist() == [0, 0] and out.block_table.tolist() == [[0, 0], [0, 0]]
    empty_w = torch.empty((2, 0), dtype=torch.int32, device=DEV)
    out = expand_decode_tokens(seq_lens, empty_w, [1, 2], max_decode_len=2)
    assert out.seq_lens.tolist() == [5, 5, 6] and out.block_table.shape == (3, 0)


@pytest.mark.parametrize("case", range(3))
def test_graph_padding_rows(case: int, rng: random.Random, seed: int) -> None:
    """CUDA-graph shapes: N = B * max_decode_len rows whatever the device lengths, so most
    rows may be padding, spread over the programs (one per request and block-table chunk;
    one request's worth when B = 0)."""
    chunk = COPY_CHUNKS[case % len(COPY_CHUNKS)]
    config = copy_chunk_config(chunk)
    max_n = 4
    for trial in range(4):
        num_reqs = [0, 1, 2, 5][trial]
        host = expansion_decode_lens(None, num_reqs, max_n, "padded")
        width = rng.choice([3, 40])  # 40: several chunks when they are 16 columns
        x = expansion_inputs(
            None, host, width=width, seq_lens="near_decode_len", ctx=40, page_ids=1 << 20,
            layout=rng.choice(LAYOUTS), device=DEV,
        )  # fmt: skip
        seq_lens, bt = x.seq_lens, x.block_table
        num_tokens = max(num_reqs, 1) * max_n + rng.choice([0, 3])
        want = expand_decode_tokens_reference(seq_lens, bt, host, num_tokens=num_tokens)
        for dl in (i32(host), host):
            out = poisoned_out(num_tokens, width, rng)
            got = expand_decode_tokens(
                seq_lens,
                bt,
                dl,
                max_decode_len=max_n,
                num_tokens=num_tokens,
                out=out,
                config=config,
            )
            msg = f"seed={seed} trial={trial} n={host} N={num_tokens} chunk={chunk}"
            assert_same(got, want, msg)


def test_lengths_below_decode_len_clamp() -> None:
    # CUDA-graph padding requests have L = 0: never negative (vLLM issue 51593).
    out = expand_decode_tokens(i32([0, 2]), i32([[1], [2]], 2, 1), 4, max_decode_len=4)
    assert out.seq_lens.tolist() == [0, 0, 0, 0, 0, 0, 1, 2]


# ----------------------------------------------------------------------------------------------
# Builder
# ----------------------------------------------------------------------------------------------


def builder(**kw) -> DecodeMetadataBuilder:
    args = {"max_num_tokens": 32, "max_num_requests": 8, "max_blocks_per_req": 6}
    args.update(kw)
    return DecodeMetadataBuilder(
        args.pop("max_num_tokens"),
        args.pop("max_num_requests"),
        args.pop("max_blocks_per_req"),
        args.pop("max_decode_len", 4),
        **args,
    )


def test_builder_modes() -> None:
    b = builder(native_decode_lens=(1, 2))
    seq_lens, bt = i32([10, 7, 12, 0]), i32(list(range(12)), 4, 3)

    m = b.build(seq_lens, bt, [2, 2, 2, 2])
    assert (m.flattened, m.requires_padding, m.next_n, m.num_tokens) == (False, False, 2, 8)
    assert m.seq_lens.tolist() == [[9, 10], [6, 7], [11, 12], [0, 0]]
    assert m.decode_lens.tolist() == [2, 2, 2, 2]
    assert m.req_id.tolist() == [0, 1, 2, 3]
    assert m.block_table is bt and m.num_requests == 4

    m = b.build(seq_lens, bt, [3, 3, 3, 3], num_tokens=14)  # uniform but not native
    assert (m.flattened, m.requires_padding, m.next_n, m.num_tokens) == (True, False, 1, 14)
    want = expand_decode_tokens_reference(seq_lens, bt, 3, num_tokens=14)
    assert_same(ExpandedDecodeTokens(m.seq_lens, m.block_table, m.decode_lens, m.req_id), want, "")

    m = b.build(seq_lens, bt, torch.tensor([3, 1, 4, 0]), num_tokens=10)  # ragged, CPU int64
    assert (m.flattened, m.requires_padding, m.next_n, m.num_tokens) == (True, True, 1, 10)
    assert m.seq_lens.tolist() == [8, 9, 10, 7, 9, 10, 11, 12, 0, 0]
    assert m.req_id.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 0, 0]

    m = b.build(i32([]), torch.empty((0, 3), dtype=torch.int32, device=DEV), [], num_tokens=2)
    assert m.flattened and m.seq_lens.tolist() == [0, 0] and m.num_requests == 0


@pytest.mark.parametrize("case", range(3))
def test_builder_random(case: int, rng: random.Random, seed: int) -> None:
    dcp_size, interleave = rng.choice(DCP_CONFIGS)
    dcp = {"dcp_size": dcp_size, "dcp_rank": rng.randrange(dcp_size), "interleave": interleave}
    b = builder(native_decode_lens=(1, 2), **dcp)
    for trial in range(4):
        num_reqs = rng.randint(0, 8)
        if rng.random() < 0.5:
            host = expansion_decode_lens(None, num_reqs, 4, "ragged")
        else:  # uniform: the native layout where n is 1 or 2
            host = expansion_decode_lens(None, num_reqs, 4, "uniform", decode_len=rng.randint(1, 3))
        x = expansion_inputs(
            None, host, width=rng.randint(0, 6), seq_lens="near_decode_len", ctx=300,
            page_ids=1 << 20, layout=rng.choice(LAYOUTS), device=DEV,
        )  # fmt: skip
        seq_lens, bt = x.seq_lens, x.block_table
        num_tokens = sum(host) + rng.randint(0, 32 - sum(host))
        m = b.build(seq_lens, bt, host, num_tokens=num_tokens)
        msg = f"seed={seed} trial={trial} n={host} dcp={dcp}"
        if not m.flattened:
            n = host[0]
            assert torch.equal(
                m.seq_lens, native_decode_seq_lens_reference(seq_lens, next_n=n, **dcp)
            ), msg
            assert m.decode_lens.tolist() == host and m.req_id.tolist() == list(range(num_reqs))
            continue
        assert m.requires_padding == (len(set(host)) > 1), msg
        want = expand_decode_tokens_reference(seq_lens, bt, host, num_tokens=num_tokens, **dcp)
        got = ExpandedDecodeTokens(m.seq_lens, m.block_table, m.decode_lens, m.req_id)
        assert_same(got, want, msg)


class _FactoryRecorder(TorchDispatchMode):
    """Records every aten op that creates a new tensor."""

    FACTORIES = ("empty", "zeros", "ones", "full", "arange", "new_", "lift_fresh", "clone", "_to")

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1]
        if name.startswith(self.FACTORIES):
            self.created.append(str(func))
        return func(*args, **(kwargs or {}))


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` records the launch, runs nothing."""

    def __init__(self) -> None:
        self.launches = 0
        self.constexprs: list[dict] = []
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))

        def launch(*args, **kwargs):
            self.launches += 1
            self.constexprs.append(kwargs)

        return launch


def test_builder_views_no_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    b = builder(native_decode_lens=(2,))
    seq_lens, bt = i32([10, 7, 12, 0]), i32(list(range(12)), 4, 3)
    cases = {
        "native": torch.tensor([2, 2, 2, 2], dtype=torch.int32),
        "uniform": torch.tensor([3, 3, 3, 3], dtype=torch.int32),
        "ragged": torch.tensor([3, 1, 4, 0], dtype=torch.int32),
    }
    # Real runs: the outputs are views of the builder's storage, stable across builds.
    for name, dl in cases.items():
        first = b.build(seq_lens, bt, dl, num_tokens=12)
        ptrs = [t.data_ptr() for t in (first.seq_lens, first.decode_lens, first.req_id)]
        for step in range(1, 3):
            again = b.build(seq_lens + step, bt, dl, num_tokens=12)
            assert [t.data_ptr() for t in (again.seq_lens, again.decode_lens, again.req_id)] == ptrs
        if name == "native":
            assert again.seq_lens.untyped_storage().data_ptr() == b._native_seq_lens.data_ptr()
            want = native_decode_seq_lens_reference(seq_lens + 2, next_n=2)
        else:
            assert again.block_table.data_ptr() == b._block_table.data_ptr()
            assert again.seq_lens.untyped_storage().data_ptr() == b._seq_lens.data_ptr()
            want = expand_decode_tokens_reference(seq_lens + 2, bt, dl, num_tokens=12).seq_lens
        assert torch.equal(again.seq_lens, want), name
    # Host path only (the interpreter itself allocates while it runs a kernel): no tensor
    # is created, and each build is exactly one launch.
    fake_expand, fake_native = _NoLaunch(), _NoLaunch()
    monkeypatch.setattr(expand_mod, "_expand_kernel", fake_expand)
    monkeypatch.setattr(expand_mod, "_native_lens_kernel", fake_native)
    for name, dl in cases.items():
        with _FactoryRecorder() as rec:
            b.build(seq_lens, bt, dl, num_tokens=12)
        assert rec.created == [], f"{name}: {rec.created}"
    assert (fake_expand.launches, fake_native.launches) == (2, 1)


def test_copy_chunk_sizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-table columns per program: about config.copy_programs programs, within the bounds,
    never wider than the (power-of-two rounded) row."""
    fake = _NoLaunch()
    monkeypatch.setattr(expand_mod, "_expand_kernel", fake)
    for num_reqs, width, want in [
        (1, 2048, 512),
        (64, 2048, 512),
        (128, 2048, 1024),
        (256, 2048, 2048),
        (600, 2048, 2048),
        (4096, 2560, 2048),
        (3, 100, 128),
        (2, 0, 16),
    ]:
        bt = torch.zeros(num_reqs, width, dtype=torch.int32, device=DEV)
        expand_decode_tokens(i32([5] * num_reqs), bt, 2, max_decode_len=2)
        assert fake.constexprs[-1]["BLOCK_W"] == want, (num_reqs, width)
        assert fake.grids[-1] == (num_reqs, max(-(-width // want), 1)), (num_reqs, width)
    # Rows given as offsets: chunks for about config.copy_programs_offsets programs.
    for num_reqs, width, want in [(64, 2048, 512), (256, 2048, 512), (512, 2048, 1024)]:
        bt = torch.zeros(num_reqs, width, dtype=torch.int32, device=DEV)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=DEV)
        expand_decode_tokens(i32([5] * num_reqs), bt, query_start_loc=qsl, max_decode_len=2)
        assert fake.constexprs[-1]["BLOCK_W"] == want, (num_reqs, width)


def test_expand_with_out_no_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _NoLaunch()
    monkeypatch.setattr(expand_mod, "_expand_kernel", fake)
    seq_lens, bt, dl = i32([10, 7, 12, 0]), i32(list(range(8)), 4, 2), i32([3, 1, 4, 0])
    offsets = i32([0, 3, 4, 8, 8])
    out = poisoned_out(10, 2, random.Random(0))
    with _FactoryRecorder() as rec:
        expand_decode_tokens(seq_lens, bt, dl, max_decode_len=4, num_tokens=10, out=out)
        expand_decode_tokens(seq_lens, bt, 2, max_decode_len=4, num_tokens=10, out=out)
        expand_decode_tokens(seq_lens, bt, [2] * 4, max_decode_len=4, num_tokens=10, out=out)
        expand_decode_tokens(
            seq_lens, bt, query_start_loc=offsets, max_decode_len=4, num_tokens=10, out=out
        )
    assert rec.created == [] and fake.launches == 4
    # One launch each: device data -> ragged kernel (sums, then offsets), host-known equal
    # lengths -> uniform.
    assert [k["UNIFORM"] for k in fake.constexprs] == [False, True, True, False]
    assert [k["QSL"] for k in fake.constexprs] == [False, False, False, True]
