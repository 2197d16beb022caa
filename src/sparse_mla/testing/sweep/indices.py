"""Random checks of the index kernels: the remap (with the tiled-atomic and flat layouts),
the DCP filter and the decode-token expansion, bit for bit against their references."""

from __future__ import annotations

import torch

from ...ops.decode_metadata import expand_decode_tokens
from ...ops.decode_metadata.naive import expand_decode_tokens_reference
from ...ops.remap import (
    RemapLayout,
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)
from ...ops.remap.naive import convert_req_index_to_global_index_reference
from ..checks import POISON
from ..inputs import expansion_decode_lens, expansion_inputs, random_remap_inputs
from .draw import Case, first_diff, log_uniform_int, to_device


def _make_remap_inputs(case: Case, g: torch.Generator):
    """The kit's hostile remap inputs at a shape drawn from ``g``, with a page stride and
    prefill rows where the case asks for them."""
    p = case.params
    k, page = p["k"], p["page"]
    tokens = log_uniform_int(g, 1, p["max_tokens"])
    num_req = int(torch.randint(1, 9, (), generator=g))
    width = int(torch.randint(1, 40, (), generator=g))
    stride = page * int(torch.randint(2, 5, (), generator=g)) if p.get("strided") else None
    req_id, block_table, idx = random_remap_inputs(
        g, tokens, k, block_size=page, num_req=num_req, width=width, invalid=p["invalid"],
        dcp_size=p.get("dcp", 1),
    )  # fmt: skip
    kwargs = dict(block_size=page)
    if stride:
        kwargs["block_stride_rows"] = stride
    if p.get("prefill"):
        num_prefill = int(torch.randint(1, 4, (), generator=g))
        ids = torch.randint(-1, num_prefill, (tokens,), generator=g, dtype=torch.int32)
        starts = torch.randint(0, 100000, (num_prefill,), generator=g, dtype=torch.int32)
        kwargs["prefill_request_ids"] = ids
        kwargs["prefill_workspace_starts"] = starts
    return req_id, block_table, idx, kwargs


def _tiled_atomic_layout(k: int) -> RemapLayout:
    """Upstream's tiling (``benchmarks/baselines``; K a multiple of 128): 128-wide column
    tiles of 4 warps that count and compact through atomics."""
    return RemapLayout(1, 128, 1, k // 128, True, False, 4)


def _flat_layout(k: int) -> RemapLayout:
    """Four rows a program as one flat run in 512-wide steps: the layout ``auto`` picks for
    large calls of odd widths, here at every size and width (it takes no compaction)."""
    return RemapLayout(4, 512, -(-4 * k // 512), 1, False, True, 4, flat=True)


def check_remap(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    req_id, bt, idx, kwargs = _make_remap_inputs(case, g)
    ref, ref_counts = convert_req_index_to_global_index_reference(
        req_id, bt, idx, return_valid_counts=True, **kwargs
    )
    kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    req_id, bt, idx = to_device(dev, req_id, bt, idx)
    for layout in ("auto", _tiled_atomic_layout(idx.shape[1]), _flat_layout(idx.shape[1])):
        out = torch.full_like(idx, POISON)
        got, counts = convert_req_index_to_global_index(
            req_id, bt, idx, return_valid_counts=True, out=out, layout=layout, **kwargs
        )
        if not torch.equal(got.cpu(), ref):
            return f"{layout}: {first_diff(got.cpu(), ref)}"
        if not torch.equal(counts.cpu(), ref_counts):
            return f"{layout}: valid counts differ"
    return None


def check_dcp(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    req_id, bt, idx, kwargs = _make_remap_inputs(case, g)
    rank = int(torch.randint(0, p["dcp"], (), generator=g))
    dcp = dict(dcp_size=p["dcp"], dcp_rank=rank, interleave=p["interleave"])
    ref, ref_counts = convert_req_index_to_global_index_reference(
        req_id, bt, idx, compact=p["compact"], return_valid_counts=True, **dcp, **kwargs
    )
    req_id, bt, idx = to_device(dev, req_id, bt, idx)
    layouts = ["auto", _tiled_atomic_layout(idx.shape[1])]
    layouts += [] if p["compact"] else [_flat_layout(idx.shape[1])]
    for layout in layouts:
        out = torch.full_like(idx, POISON)
        got, counts = filter_and_convert_dcp_index(
            req_id,
            bt,
            idx,
            compact=p["compact"],
            return_valid_counts=True,
            out=out,
            layout=layout,
            **dcp,
            **kwargs,
        )
        got = got.cpu()
        if layout != "auto" and layout.atomic and p["compact"]:
            # Atomic compaction fills the prefix in arbitrary order: compare as sets.
            got, want = got.sort(dim=1).values, ref.sort(dim=1).values
        else:
            want = ref
        if not torch.equal(got, want):
            return f"{layout}: {first_diff(got, want)}"
        if not torch.equal(counts.cpu(), ref_counts):
            return f"{layout}: valid counts differ"
    return None


def check_expand(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    p = case.params
    n = p["n"]
    num_req = int(torch.randint(0, 33, (), generator=g))
    width = int(torch.randint(1, 70, (), generator=g))
    kind = "ragged" if p["ragged"] else "uniform"
    x = expansion_inputs(
        g, expansion_decode_lens(g, num_req, n, kind), width=width, max_decode_len=n,
        layout="wide_rows", device=dev,
    )  # fmt: skip
    seq_lens, bt, decode_lens = x.seq_lens, x.block_table, torch.tensor(x.decode_lens).int()
    num_tokens = x.total + (int(torch.randint(1, 17, (), generator=g)) if p["padded"] else 0)
    rank = int(torch.randint(0, p["dcp"], (), generator=g))
    kw = dict(max_decode_len=n, num_tokens=num_tokens, dcp_size=p["dcp"], dcp_rank=rank)
    ref = expand_decode_tokens_reference(seq_lens.cpu(), bt.cpu(), decode_lens, **kw)
    # Device lengths (each program sums them), host-known ones (the uniform kernel, or the
    # ragged one given row offsets), and device row offsets (query_start_loc).
    forms = (
        ("device decode_lens", dict(decode_lens=decode_lens.to(dev), uniform=False)),
        ("host decode_lens", dict(decode_lens=decode_lens.tolist())),
        ("query_start_loc", dict(query_start_loc=x.query_start_loc())),
    )
    for form, lens in forms:
        got = expand_decode_tokens(seq_lens, bt, **lens, **kw)
        for name in ("seq_lens", "block_table", "decode_lens", "req_id"):
            a, b = getattr(got, name).cpu(), getattr(ref, name)
            if not torch.equal(a, b):
                return f"{form} {name}: {first_diff(a, b)}"
    return None
