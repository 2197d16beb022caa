"""Decode-metadata expansion: bad and hostile inputs get a clear exception or a bounded,
documented result (split from test_decode_metadata.py)."""

from __future__ import annotations

import random

import pytest
import torch

from sparse_mla._runtime import default_device
from sparse_mla.ops.decode_metadata import (
    DecodeMetadataBuilder,
    ExpandConfig,
    dcp_local_seq_lens,
    expand_decode_tokens,
    native_decode_seq_lens,
)
from sparse_mla.ops.decode_metadata import expand as expand_mod
from sparse_mla.ops.decode_metadata.naive import (
    dcp_local_len,
)
from sparse_mla.testing import (
    POISON,
    expansion_inputs,
)

from .test_decode_metadata import (
    COPY_CHUNKS,
    LAYOUTS,
    _NoLaunch,
    builder,
    copy_chunk_config,
    i32,
    poisoned_out,
)

DEV = default_device()


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def query_start_loc_model(
    seq_lens: list[int], bt: torch.Tensor, q: list[int], max_n: int, num_tokens: int
) -> tuple[dict, set]:
    """What the docstring promises for any ``query_start_loc``: each row's expected
    (seq_len, block-table row, req_id), and the rows claimed twice (any claimant's values)."""
    clamp = lambda v, lo, hi: min(max(v, lo), hi)  # noqa: E731
    rows: dict[int, list] = {}
    total = clamp(q[-1] - q[0], 0, num_tokens)
    for r in range(total, num_tokens):  # padding
        rows.setdefault(r, []).append((0, [0] * bt.shape[1], 0))
    for b, length in enumerate(seq_lens):
        start = clamp(q[b] - q[0], 0, num_tokens)
        n = clamp(q[b + 1] - q[0] - start, 0, max_n)
        for j in range(n):
            if start + j < num_tokens:
                seq = max(max(length, 0) - n + j + 1, 0)
                rows.setdefault(start + j, []).append((seq, bt[b].tolist(), b))
    return rows, {r for r, c in rows.items() if len(c) > 1}


@pytest.mark.parametrize("case", range(4))
def test_query_start_loc_adversarial(case: int, rng: random.Random, seed: int) -> None:
    """Out-of-order, negative, huge and too-far-apart offsets stay inside the N rows: rows
    one request claims hold its values, rows several claim hold entries of theirs, rows none
    claims keep what was there."""
    config = copy_chunk_config(COPY_CHUNKS[case % len(COPY_CHUNKS)])
    max_n = 3
    for trial in range(4):
        num_reqs = rng.randint(1, 6)
        base = rng.choice([0, 7, -(2**31), 2**31 - 1])
        q = [base]
        for _ in range(num_reqs):
            step = rng.choice([0, 1, 2, 3, 5, -2, -(2**31), 2**31 - 1])
            q.append(max(min(q[-1] + step, 2**31 - 1), -(2**31)))
        x = expansion_inputs(
            None, [max_n] * num_reqs, width=rng.choice([1, 5, 40]), seq_lens="hostile",
            page_ids=1 << 20, layout=rng.choice(LAYOUTS), device=DEV,
        )  # fmt: skip
        seq_lens, bt = x.seq_lens.tolist(), x.block_table
        num_tokens = rng.randint(0, num_reqs * max_n + 2)
        out = poisoned_out(num_tokens, bt.shape[1], rng)
        got = expand_decode_tokens(
            i32(seq_lens), bt, query_start_loc=i32(q), max_decode_len=max_n,
            num_tokens=num_tokens, out=out, config=config,
        )  # fmt: skip
        rows, twice = query_start_loc_model(seq_lens, bt, q, max_n, num_tokens)
        msg = f"seed={seed} trial={trial} q={q} L={seq_lens} N={num_tokens}"
        for r in range(num_tokens):
            row = (got.seq_lens[r].item(), got.block_table[r].tolist(), got.req_id[r].item())
            if r not in rows:
                assert row[0] == POISON and got.decode_lens[r].item() == POISON, f"row {r} {msg}"
            elif r in twice:  # each entry from one of the claimants (programs race)
                for field, got_v in enumerate((row[0], *row[1], row[2])):
                    options = {(c[0], *c[1], c[2])[field] for c in rows[r]}
                    assert got_v in options, f"row {r} entry {field}: {got_v} ({msg})"
            else:
                assert row == rows[r][0], f"row {r}: {row} != {rows[r][0]} ({msg})"
                assert got.decode_lens[r].item() == 1, f"row {r} ({msg})"


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    return i32([10, 7]), i32([[1, 2], [3, 4]], 2, 2)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        ({"seq_lens": torch.tensor([10, 7])}, TypeError, "seq_lens"),
        ({"seq_lens": [10, 7]}, TypeError, "seq_lens"),
        ({"seq_lens": torch.tensor([[10, 7]], dtype=torch.int32)}, ValueError, "seq_lens"),
        ({"block_table": torch.tensor([[1, 2], [3, 4]])}, TypeError, "block_table"),
        ({"block_table": torch.zeros(2, 2, dtype=torch.float32)}, TypeError, "block_table"),
        ({"block_table": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, "block_table"),
        (
            {"block_table": torch.zeros(2, 2, dtype=torch.int32, device="meta")},
            ValueError,
            "block_table",
        ),
        ({"decode_lens": torch.tensor([1, 1], dtype=torch.int16)}, TypeError, "decode_lens"),
        (
            {"decode_lens": torch.tensor([1, 1], dtype=torch.int32, device="meta")},
            ValueError,
            "decode_lens",
        ),
        ({"decode_lens": [1, 1, 1]}, ValueError, "decode_lens"),
        ({"decode_lens": i32([1, 1, 1])}, ValueError, "decode_lens"),
        ({"decode_lens": [1, -1]}, ValueError, "decode_lens"),
        ({"decode_lens": -1}, ValueError, "decode_lens"),
        ({"decode_lens": [1, 1.0]}, TypeError, "decode_lens"),
        ({"decode_lens": "11"}, TypeError, "decode_lens"),
        ({"decode_lens": True}, TypeError, "decode_lens"),
        ({"decode_lens": [1, 5]}, ValueError, "max_decode_len"),
        ({"decode_lens": 5}, ValueError, "decode_lens"),
        ({"max_decode_len": 0}, ValueError, "max_decode_len"),
        ({"max_decode_len": 2.0}, TypeError, "max_decode_len"),
        ({"num_tokens": 3}, ValueError, "num_tokens"),
        ({"num_tokens": -1}, ValueError, "num_tokens"),
        ({"dcp_size": 0}, ValueError, "dcp_size"),
        ({"dcp_size": 2, "dcp_rank": 2}, ValueError, "dcp_rank"),
        ({"dcp_size": 2, "dcp_rank": -1}, ValueError, "dcp_rank"),
        ({"interleave": 0}, ValueError, "interleave"),
        ({"uniform": 1}, TypeError, "uniform"),
        ({"uniform": True, "decode_lens": [1, 2]}, ValueError, "uniform"),
        ({"uniform": True, "decode_lens": "device"}, ValueError, "uniform"),
        ({"decode_lens": None}, ValueError, "exactly one of decode_lens and query_start_loc"),
        ({"query_start_loc": "qsl"}, ValueError, "exactly one of decode_lens and query_start_loc"),
        ({"decode_lens": None, "query_start_loc": i32([0, 2])}, ValueError, "query_start_loc"),
        (
            {"decode_lens": None, "query_start_loc": torch.tensor([0, 2, 4])},
            TypeError,
            "query_start_loc",
        ),
        (
            {"decode_lens": None, "query_start_loc": i32([0, 2, 4]).to("meta")},
            ValueError,
            "query_start_loc",
        ),
        (
            {"decode_lens": None, "query_start_loc": "qsl", "uniform": True},
            ValueError,
            "uniform",
        ),
    ],
)
def test_expand_bad_input(change: dict, exc: type, match: str) -> None:
    seq_lens, bt = _good()
    args = {"seq_lens": seq_lens, "block_table": bt, "decode_lens": [2, 2], "max_decode_len": 4}
    args.update(change)
    if isinstance(args["decode_lens"], str) and args["decode_lens"] == "device":
        args["decode_lens"] = i32([2, 2])
    if args.get("query_start_loc") == "qsl":
        args["query_start_loc"] = i32([0, 2, 4])
    with pytest.raises(exc, match=match):
        expand_decode_tokens(
            args.pop("seq_lens"), args.pop("block_table"), args.pop("decode_lens"), **args
        )


@pytest.mark.parametrize(
    "field,bad,exc",
    [
        ("seq_lens", torch.zeros(5, dtype=torch.int32), ValueError),
        ("seq_lens", torch.zeros(4, dtype=torch.int64), TypeError),
        ("block_table", torch.zeros(4, 3, dtype=torch.int32), ValueError),
        ("block_table", torch.zeros(1, 2, dtype=torch.int32).expand(4, 2), ValueError),
        ("req_id", torch.zeros(1, dtype=torch.int32).expand(4), ValueError),
        ("block_table", torch.zeros(4, 2, dtype=torch.int32, device="meta"), ValueError),
        ("decode_lens", torch.zeros(4, 1, dtype=torch.int32), ValueError),
        ("req_id", torch.zeros(4, dtype=torch.float32), TypeError),
    ],
)
def test_expand_bad_out(field: str, bad: torch.Tensor, exc: type) -> None:
    seq_lens, bt = _good()
    out = poisoned_out(4, 2, random.Random(0))._replace(**{field: bad})
    with pytest.raises(exc, match=f"out.{field}"):
        expand_decode_tokens(seq_lens, bt, 2, max_decode_len=2, out=out)
    with pytest.raises(TypeError, match="out"):
        expand_decode_tokens(seq_lens, bt, 2, max_decode_len=2, out=tuple(out))


def test_native_and_dcp_bad_input() -> None:
    seq_lens = i32([3, 4])
    with pytest.raises(TypeError, match="seq_lens"):
        native_decode_seq_lens(seq_lens.long(), next_n=2)
    with pytest.raises(ValueError, match="next_n"):
        native_decode_seq_lens(seq_lens, next_n=0)
    with pytest.raises(ValueError, match="out"):
        native_decode_seq_lens(seq_lens, next_n=2, out=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="out"):
        native_decode_seq_lens(seq_lens, next_n=2, out=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="out must not be a broadcast view"):
        out = torch.zeros(1, 2, dtype=torch.int32, device=DEV).expand(2, 2)
        native_decode_seq_lens(seq_lens, next_n=2, out=out)
    with pytest.raises(ValueError, match="dcp_rank"):
        native_decode_seq_lens(seq_lens, next_n=2, dcp_size=2, dcp_rank=3)
    with pytest.raises(TypeError, match="seq_lens"):
        dcp_local_seq_lens(seq_lens.float(), dcp_size=2, dcp_rank=0)
    with pytest.raises(ValueError, match="dcp_size"):
        dcp_local_seq_lens(seq_lens, dcp_size=0, dcp_rank=0)
    with pytest.raises(ValueError, match="dcp_rank"):
        dcp_local_seq_lens(seq_lens, dcp_size=4, dcp_rank=4)
    with pytest.raises(ValueError, match="interleave"):
        dcp_local_seq_lens(seq_lens, dcp_size=2, dcp_rank=0, interleave=0)
    with pytest.raises(ValueError, match="out"):
        dcp_local_seq_lens(seq_lens, dcp_size=2, dcp_rank=0, out=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        dcp_local_seq_lens(
            seq_lens, dcp_size=2, dcp_rank=0, out=torch.zeros(2, dtype=torch.int32, device="meta")
        )


def test_builder_bad_input() -> None:
    with pytest.raises(ValueError, match="max_decode_len"):
        builder(max_decode_len=0)
    with pytest.raises(ValueError, match="native_decode_lens"):
        builder(native_decode_lens=(0,))
    with pytest.raises(ValueError, match="native_decode_lens"):
        builder(native_decode_lens=(5,))
    with pytest.raises(ValueError, match="dcp_rank"):
        builder(dcp_size=2, dcp_rank=2)
    with pytest.raises(ValueError, match="interleave"):
        builder(interleave=0)
    with pytest.raises(ValueError, match="max_num_tokens"):
        builder(max_num_tokens=-1)
    b = builder()
    seq_lens, bt = i32([10, 7]), i32([[1, 2], [3, 4]], 2, 2)
    with pytest.raises(ValueError, match="max_num_tokens"):
        b.build(seq_lens, bt, [4, 4], num_tokens=33)
    with pytest.raises(ValueError, match="num_tokens"):
        b.build(seq_lens, bt, [4, 4], num_tokens=7)
    with pytest.raises(ValueError, match="max_num_requests"):
        b.build(i32([1] * 9), torch.zeros(9, 2, dtype=torch.int32, device=seq_lens.device), [1] * 9)
    with pytest.raises(ValueError, match="max_blocks_per_req"):
        b.build(seq_lens, torch.zeros(2, 7, dtype=torch.int32, device=seq_lens.device), [1, 1])
    with pytest.raises(ValueError, match="decode_lens"):
        b.build(seq_lens, bt, [1])
    with pytest.raises(ValueError, match="decode_lens"):
        b.build(seq_lens, bt, [1, -2])
    with pytest.raises(ValueError, match="max_decode_len"):
        b.build(seq_lens, bt, [1, 5])
    with pytest.raises(TypeError, match="decode_lens"):
        b.build(seq_lens, bt, torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="decode_lens"):
        b.build(seq_lens, bt, torch.tensor([1, 1], dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="seq_lens"):
        b.build(seq_lens.long(), bt, [1, 1])
    with pytest.raises(ValueError, match="block_table"):
        b.build(seq_lens, bt.to("meta"), [1, 1])
    with pytest.raises(ValueError, match="seq_lens"):
        b.build(seq_lens.to("meta"), bt.to("meta"), [1, 1])


def test_block_table_too_wide_for_the_grid() -> None:
    # More column chunks than CUDA's grid allows: rejected before any launch (no memory:
    # a broadcast view of one column).
    wide = torch.zeros(1, 1, dtype=torch.int32, device=DEV).expand(1, 65535 * 2048 + 1)
    with pytest.raises(ValueError, match="block_table has .* columns; the expansion takes at most"):
        expand_decode_tokens(i32([5]), wide, 1, max_decode_len=1)


def test_host_bounds_of_the_kernels() -> None:
    from sparse_mla.ops.decode_metadata import native_decode_seq_lens
    from sparse_mla.ops.decode_metadata.expand import MAX_NEXT_N, MAX_REQUESTS_RAGGED

    dev = default_device()
    b = MAX_REQUESTS_RAGGED + 1
    ones = torch.ones(b, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="the ragged kernel takes at most"):
        expand_decode_tokens(
            ones,
            torch.zeros(b, 1, dtype=torch.int32, device=dev),
            ones,
            max_decode_len=1,
            num_tokens=b,
        )
    with pytest.raises(ValueError, match="next_n must be <="):
        native_decode_seq_lens(ones[:2], next_n=MAX_NEXT_N + 1)


def test_out_buffers_that_share_memory_are_rejected() -> None:
    """F02/F04: out= fields over the inputs or over each other raise (they were accepted)."""
    seq_lens, bt = i32([10, 7]), i32([[1, 2], [3, 4]], 2, 2)
    out = poisoned_out(4, 2, random.Random(0))
    two = poisoned_out(2, 2, random.Random(0))
    with pytest.raises(ValueError, match="out.seq_lens overlaps seq_lens"):
        expand_decode_tokens(seq_lens, bt, 1, max_decode_len=2, out=two._replace(seq_lens=seq_lens))
    big = torch.zeros(4, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="out.block_table overlaps block_table"):
        expand_decode_tokens(
            seq_lens, big[:2], 2, max_decode_len=2, out=out._replace(block_table=big)
        )
    with pytest.raises(ValueError, match="out.decode_lens overlaps out.req_id"):
        expand_decode_tokens(
            seq_lens, bt, 2, max_decode_len=2, out=out._replace(req_id=out.decode_lens)
        )
    qsl = i32([0, 2, 4, 0])
    with pytest.raises(ValueError, match="out.seq_lens overlaps query_start_loc"):
        expand_decode_tokens(
            seq_lens,
            bt,
            None,
            query_start_loc=qsl[:3],
            max_decode_len=2,
            out=out._replace(seq_lens=qsl),
        )
    with pytest.raises(ValueError, match="out overlaps seq_lens"):
        native_decode_seq_lens(seq_lens, next_n=1, out=seq_lens.view(2, 1))
    lens = i32([5, 6, 7])
    with pytest.raises(ValueError, match="out overlaps seq_lens"):
        dcp_local_seq_lens(lens[:2], dcp_size=2, dcp_rank=0, out=lens[1:])
    dcp_local_seq_lens(lens, dcp_size=2, dcp_rank=0, out=lens)  # in place stays allowed
    assert lens.cpu().tolist() == [3, 3, 4]


def test_max_decode_len_past_the_largest_tile_is_named() -> None:
    """F07: a request's rows are one tile; past Triton's largest block the argument is named."""
    from sparse_mla.ops.decode_metadata.expand import MAX_DECODE_LEN

    seq_lens, bt = i32([10, 7]), i32([[1, 2], [3, 4]], 2, 2)
    with pytest.raises(ValueError, match=f"max_decode_len must be <= {MAX_DECODE_LEN}"):
        expand_decode_tokens(seq_lens, bt, i32([1, 1]), max_decode_len=MAX_DECODE_LEN + 1)
    with pytest.raises(ValueError, match=f"max_decode_len must be <= {MAX_DECODE_LEN}"):
        builder(max_decode_len=MAX_DECODE_LEN + 1)


def test_builder_takes_an_int_and_dcp_ranges() -> None:
    """F10: decode_lens=2 means 2 per request (was a message 'must be an int ... got int');
    F08: dcp_size past int32 is named."""
    b = builder()
    seq_lens, bt = i32([10, 7]), i32([[1, 2], [3, 4]], 2, 2)
    m = b.build(seq_lens, bt, 2)
    assert m.num_tokens == 4 and m.seq_lens.cpu().tolist() == [9, 10, 6, 7]
    with pytest.raises(ValueError, match="dcp_size must be <= 2147483647"):
        builder(dcp_size=2**31)
    with pytest.raises(ValueError, match="dcp_size must be <= 2147483647"):
        expand_decode_tokens(seq_lens, bt, 2, max_decode_len=2, dcp_size=2**31)


def test_dcp_local_len_agrees_with_the_shared_rule() -> None:
    """The group-by-group count equals ops/_common's position-by-position reference."""
    from sparse_mla.ops._common.dcp import dcp_local_count_reference

    lens = torch.arange(0, 300)
    for dcp_size, interleave in ((1, 1), (2, 1), (3, 4), (4, 16)):
        for rank in range(dcp_size):
            want = dcp_local_count_reference(lens, rank, dcp_size, interleave).tolist()
            got = [dcp_local_len(int(v), dcp_size, rank, interleave) for v in lens]
            assert got == want, (dcp_size, interleave, rank)


def test_expand_config_and_enable_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy chunk follows the config passed per call (never module state); enable_pdl
    reaches every launch (False: PDL mode 0; None/True: config.pdl where supported)."""
    fake = _NoLaunch()
    monkeypatch.setattr(expand_mod, "_expand_kernel", fake)
    bt = torch.zeros(64, 2048, dtype=torch.int32, device=DEV)
    expand_decode_tokens(i32([5] * 64), bt, 2, max_decode_len=2)
    assert fake.constexprs[-1]["BLOCK_W"] == 512 and fake.constexprs[-1]["EVICT"] == "evict_first"
    cfg = ExpandConfig(min_copy_chunk=64, copy_programs=2048, store_evict="")
    expand_decode_tokens(i32([5] * 64), bt, 2, max_decode_len=2, config=cfg)
    assert fake.constexprs[-1]["BLOCK_W"] == 64 and fake.constexprs[-1]["EVICT"] == ""
    modes = []
    monkeypatch.setattr(
        expand_mod,
        "pdl_launch",
        lambda dev, mode, on: modes.append(0 if on is False else mode) or {},
    )
    for on in (None, True, False):
        expand_decode_tokens(i32([5] * 64), bt, 2, max_decode_len=2, enable_pdl=on)
    expand_decode_tokens(i32([5] * 64), bt, 2, max_decode_len=2, config=ExpandConfig(pdl=0))
    assert modes == [2, 2, 0, 0]
    b = DecodeMetadataBuilder(8, 4, 16, 2, device=DEV, config=ExpandConfig(pdl=1))
    for on in (None, False):
        b.build(
            i32([5, 6]), torch.zeros(2, 16, dtype=torch.int32, device=DEV), [2, 2], enable_pdl=on
        )
    assert modes[4:] == [1, 0]
    with pytest.raises(TypeError, match="config must be an ExpandConfig"):
        expand_decode_tokens(i32([5]), bt[:1], 2, max_decode_len=2, config={"pdl": 2})
    with pytest.raises(ValueError, match="config.min_copy_chunk must be a power of two"):
        expand_decode_tokens(
            i32([5]), bt[:1], 2, max_decode_len=2, config=ExpandConfig(min_copy_chunk=3)
        )
    with pytest.raises(ValueError, match="config.pdl"):  # 2.0 == 2: the type is checked too
        expand_decode_tokens(i32([5]), bt[:1], 2, max_decode_len=2, config=ExpandConfig(pdl=2.0))
