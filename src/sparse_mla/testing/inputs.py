"""Input generators shared by the tests, ``sparse-mla verify``, ``sparse-mla bench`` and the GPU
scripts: random caches, indices, scores, lengths and block tables."""

from __future__ import annotations

import random
from typing import NamedTuple

import torch


def random_mla_cache(
    num_pages: int,
    block_size: int,
    *,
    fp8: bool = False,
    g: torch.Generator | None,
    scale: float = 1.0,
    arbitrary_scales: bool = False,
    device: torch.device | str = "cpu",
    chunk: int = 1 << 18,
    format: str | None = None,
) -> torch.Tensor:
    """An MLA latent cache (``new_mla_cache``'s formats) with every slot holding a random
    latent of magnitude ``scale``, written by the reference writer (fp8: power-of-two scales)
    ``chunk`` rows at a time (engine-size caches: drawn on ``g``'s device, ``None``: torch's
    default generator on ``device``). ``format``: ``new_mla_cache``'s name (default ``"fp8"``
    or ``"bf16"`` by ``fp8``; ``"model1_fp8"`` / ``"model1_bf16"``: 512-wide rows).
    ``arbitrary_scales`` (V3.2 fp8; other formats ignore it) then multiplies each fp32 scale
    by a random factor in [0.5, 2) (the stored e4m3 values stay, so each row is still an exact
    e4m3 * scale)."""
    from ..ops.kv_cache import new_mla_cache
    from ..ops.kv_cache.naive import write_mla_latent_reference, write_model1_latent_reference

    format = format or ("fp8" if fp8 else "bf16")
    model1 = format.startswith("model1")
    write = write_model1_latent_reference if model1 else write_mla_latent_reference
    width, nope = (512, 448) if model1 else (576, 512)
    draw_on = g.device if g is not None else device
    rows = num_pages * block_size
    cache = new_mla_cache(num_pages, block_size, format=format, device=device)
    for s0 in range(0, rows, chunk):
        n = min(chunk, rows - s0)
        kv = (torch.randn(n, width, generator=g, device=draw_on) * scale).bfloat16().to(device)
        slots = torch.arange(s0, s0 + n, device=device)
        write(kv[:, :nope], kv[:, nope:], cache, slots)
    if arbitrary_scales and format == "fp8":
        sc = cache.view(rows, -1)[:, 512:528].view(torch.float32)
        factor = 0.5 + 1.5 * torch.rand(sc.shape, generator=g, device=draw_on)
        sc.mul_(factor.to(device))
    return cache


def random_attention_indices(
    g: torch.Generator | None,
    num_tokens: int,
    topk: int,
    num_rows: int,
    *,
    invalid_tail: int = 0,
    invalid_frac: float = 0.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int32 ``[T, topk]`` random slots in ``[0, num_rows)`` on ``g``'s device (``g`` None:
    torch's default generator on ``device``); the last ``invalid_tail`` of a row and a random
    ``invalid_frac`` of the rest are -1."""
    dev = g.device if g is not None else (device or "cpu")
    shape = (num_tokens, topk)
    idx = torch.randint(0, max(num_rows, 1), shape, generator=g, dtype=torch.int32, device=dev)
    if invalid_frac > 0:
        idx[torch.rand(shape, generator=g, device=dev) < invalid_frac] = -1
    if invalid_tail > 0:
        idx[:, topk - invalid_tail :] = -1
    return idx


def hostile_attention_indices(
    g: torch.Generator | None,
    num_tokens: int,
    topk: int,
    num_rows: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int32 ``[T, topk]`` slots in ``[0, num_rows)`` on ``g``'s device (``g`` None: torch's
    default generator on ``device``) with every kind of slot a kernel must skip: about 10%
    -1, 3% past the cache (``num_rows + 5``), 2% other negatives (-7); row 1 all -1 (an
    empty row) and the last cache row three times at the start of row 0 (a repeated slot)."""
    dev = g.device if g is not None else (device or "cpu")
    shape = (num_tokens, topk)
    idx = torch.randint(0, max(num_rows, 1), shape, generator=g, dtype=torch.int32, device=dev)
    r = torch.rand(shape, generator=g, device=dev)
    idx[r < 0.1] = -1
    idx[(r >= 0.1) & (r < 0.13)] = num_rows + 5
    idx[(r >= 0.13) & (r < 0.15)] = -7
    if num_tokens > 1:
        idx[1] = -1
    if num_tokens > 0:
        idx[0, :3] = num_rows - 1
    return idx


def random_remap_inputs(
    g: torch.Generator,
    tokens: int,
    k: int,
    *,
    block_size: int,
    num_req: int,
    width: int,
    invalid: float,
    dcp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hostile remap inputs (CPU): ``(req_id int32 [T], block_table int32 [R, width],
    positions int32 [T, k])``. The block table is a view with rows 3 wider (its row stride
    is not its width); positions run to 1.25x the addressable range (``width * block_size *
    dcp_size``), so a tail maps past the table; a random ``invalid`` share of them is -1."""
    bt_wide = torch.randint(0, 5000, (num_req, width + 3), generator=g, dtype=torch.int32)
    span = int(width * block_size * dcp_size * 1.25) + 1
    idx = torch.randint(0, span, (tokens, k), generator=g, dtype=torch.int32)
    idx[torch.rand((tokens, k), generator=g) < invalid] = -1
    req_id = torch.randint(0, num_req, (tokens,), generator=g, dtype=torch.int32)
    return req_id, bt_wide[:, :width], idx


def engine_remap_inputs(
    g: torch.Generator | None,
    tokens: int,
    k: int,
    *,
    width: int,
    ctx: int,
    max_requests: int,
    ascending: bool = False,
    page_ids: int = 1 << 24,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an engine's decode step hands the remap (the bench's timing inputs): ``(req_id
    int32 [T], block_table int32 [R, width], positions int32 [T, k])`` for ``R = min(T,
    max_requests)`` requests, each owning consecutive rows, of context lengths L uniform in
    [1, ``ctx``], with random page ids in [0, ``page_ids``); a row's first ``min(k, L)``
    entries are random positions below L (sorted when ``ascending``: ``select_topk``'s
    order), the rest -1. Drawn on ``g``'s device (``g`` None: torch's default generator on
    ``device``)."""
    dev = g.device if g is not None else (device or "cpu")
    r = min(tokens, max_requests)
    req_id = (torch.arange(tokens, device=dev) * r // tokens).to(torch.int32)
    lens = torch.randint(1, ctx + 1, (r,), generator=g, device=dev)
    block_table = torch.randint(0, page_ids, (r, width), generator=g, dtype=torch.int32, device=dev)
    row_lens = lens[req_id.long()]
    pos = (torch.rand(tokens, k, generator=g, device=dev) * row_lens[:, None]).long()
    if ascending:
        pos = pos.sort(dim=1).values
    col = torch.arange(k, device=dev)[None, :]
    idx = torch.where(col < torch.clamp(row_lens, max=k)[:, None], pos, -1).to(torch.int32)
    return req_id, block_table, idx


# ---------------------------------------------------------------------------------------
# Decode context parallelism (sparse_mla.dcp): inputs of one simulated rank
# ---------------------------------------------------------------------------------------


def dcp_scores(
    rows: int, n: int, *, kind: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """fp32 ``[rows, n]`` indexer-like scores for DCP top-k tests (CPU).

    ``kind``: ``"normal"`` (distinct with probability ~1), ``"ties"`` (three values, so
    ties straddle every rank), ``"special"`` (ties plus -inf, NaN, -0.0 and +0.0).
    """
    if kind == "normal":
        return torch.randn(rows, n, generator=generator)
    x = torch.randint(0, 3, (rows, n), generator=generator).float()
    if kind == "ties":
        return x
    if kind != "special":
        raise ValueError(f"kind must be 'normal', 'ties' or 'special', got {kind!r}")
    pick = torch.randint(0, 8, (rows, n), generator=generator)
    x = torch.where(pick == 0, float("-inf"), x)
    x = torch.where(pick == 1, float("nan"), x)
    x = torch.where(pick == 2, -0.0, x)
    return torch.where(pick == 3, 0.0, x)


def dcp_shard_scores(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    fill: float = float("nan"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DCP rank's view of full rows: the scores of the positions it owns, in local order.

    Args:
        logits: fp32 ``[T, N]``, scores of global positions.
        seq_lens: int32 ``[T]``, global lengths (clamped to ``[0, N]``).

    Returns:
        ``(local_logits fp32 [T, N_local], local_seq_lens int32 [T])``: column ``l`` is the
        rank's ``l``-th owned position; ``N_local`` is the same on every rank (the most any
        rank owns of N), columns the rank does not have hold ``fill`` (which a correct
        kernel never reads as a candidate).
    """
    from ..ops._common.dcp import dcp_local_count_reference, dcp_owner_reference

    rows, n = logits.shape
    pos = torch.arange(n)
    mine = pos[dcp_owner_reference(pos, dcp_size, interleave) == dcp_rank]
    n_local = max(
        int(dcp_local_count_reference(torch.tensor([n]), r, dcp_size, interleave))
        for r in range(dcp_size)
    )
    local = torch.full((rows, n_local), fill, dtype=torch.float32)
    local[:, : mine.numel()] = logits[:, mine]
    lens = seq_lens.clamp(0, n).to(torch.int32)
    local_lens = dcp_local_count_reference(lens, dcp_rank, dcp_size, interleave)
    return local, local_lens.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Input generators
# --------------------------------------------------------------------------------------------


def dcp_partials(
    world: int, tokens: int, heads: int, dim: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every simulated rank's attention partial (CPU): out fp32 ``[W, T, H, D]`` and lse fp32
    ``[W, T, H]``. With more than two rows: only rank 0 saw row 0, nobody saw row 1, half of
    rank 0's heads saw nothing in row 2; a partial with lse -inf holds NaN in its out (which
    a combine must never read)."""
    outs = torch.randn(world, tokens, heads, dim, generator=g)
    lses = 4 * torch.randn(world, tokens, heads, generator=g)
    if tokens > 2:
        lses[1:, 0] = float("-inf")
        lses[:, 1] = float("-inf")
        lses[0, 2, ::2] = float("-inf")
    outs = torch.where(torch.isinf(lses)[..., None], float("nan"), outs)
    return outs, lses


def ragged_lens(total: int, n: int, rng: random.Random) -> list[int]:
    """Decode lengths uniform in [1, n] whose sum is exactly ``total`` (the last one trimmed)."""
    lens: list[int] = []
    left = total
    while left > 0:
        v = min(rng.randint(1, n), left)
        lens.append(v)
        left -= v
    return lens


def distinct_block_table(
    num_pages: int,
    rows: int,
    width: int,
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """int32 ``[rows, width]`` block table of distinct random page ids in ``[0, num_pages)``
    (every request its own pages, scattered over the cache); needs ``rows * width <=
    num_pages``. ``generator`` must live on ``device``."""
    if rows * width > num_pages:
        raise ValueError(f"{rows} x {width} distinct pages need num_pages >= {rows * width}")
    perm = torch.randperm(num_pages, device=device, generator=generator)
    return perm[: rows * width].view(rows, width).to(torch.int32)


#: The memory layouts :func:`block_table_view` lays a block table out in.
BLOCK_TABLE_LAYOUTS = ("contiguous", "wide_rows", "column_step", "transposed")


def block_table_view(
    values: torch.Tensor, layout: str, *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``values`` (int32 ``[R, W]``) on ``device`` in one of :data:`BLOCK_TABLE_LAYOUTS`:
    contiguous; ``wide_rows``, a view of rows 7 wider (a capacity-sized table: the row
    stride is not the width); ``column_step``, every other column of a wider tensor; or
    ``transposed``, column-major storage. What the view leaves out holds the poison value."""
    from .checks import POISON

    rows, width = values.shape
    if layout == "contiguous":
        return values.to(device)
    if layout == "transposed":
        return values.t().contiguous().t().to(device)
    if layout not in BLOCK_TABLE_LAYOUTS:
        raise ValueError(f"layout must be one of {BLOCK_TABLE_LAYOUTS}, got {layout!r}")
    wide = layout == "wide_rows"
    big = torch.full((rows, width + 7 if wide else 2 * width), POISON, dtype=torch.int32)
    big = big.to(device)
    view = big[:, :width] if wide else big[:, ::2]
    view.copy_(values.to(device))
    return view


def indexer_queries(
    rows: int,
    heads: int,
    dim: int,
    *,
    fp8: bool,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    integer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random indexer queries ``[rows, heads, dim]`` (bf16, or e4m3 when ``fp8``) and fp32
    head weights ``[rows, heads]`` scaled by ``(heads * dim)^-1/2`` as V3.2 folds them.
    ``integer``: small integers instead (queries in [-3, 3], weights in [-4, 4], unscaled),
    whose logits every path computes exactly."""
    if integer:
        q = torch.randint(-3, 4, (rows, heads, dim), device=device, generator=generator).float()
        w = torch.randint(-4, 5, (rows, heads), device=device, generator=generator).float()
    else:
        q = torch.randn(rows, heads, dim, device=device, generator=generator)
        w = torch.randn(rows, heads, device=device, generator=generator) * (heads * dim) ** -0.5
    return q.to(torch.float8_e4m3fn if fp8 else torch.bfloat16), w


def filled_indexer_cache(
    num_pages: int,
    block_size: int,
    dim: int,
    *,
    fp8: bool,
    device: torch.device | str | None = None,
    chunk: int = 1 << 20,
    generator: torch.Generator | None = None,
    integer: bool = False,
    scale: float = 1.0,
    reference_writer: bool = False,
) -> torch.Tensor:
    """An indexer K cache of ``num_pages`` pages of normal bf16 keys of standard deviation
    ``scale`` (``integer``: integers in [-3, 3]), written through ``write_indexer_k`` (so the
    fp8 format holds real scales; ``reference_writer``: its PyTorch reference, so a check of
    another kernel does not lean on the writer kernel) ``chunk`` tokens at a time to bound
    the temporaries. ``generator`` must live on ``device``."""
    from .. import new_indexer_k_cache, write_indexer_k
    from .._runtime import canonical_device
    from ..ops.kv_cache.naive import write_indexer_k_reference

    write = write_indexer_k_reference if reference_writer else write_indexer_k
    device = canonical_device(device)
    cache = new_indexer_k_cache(num_pages, block_size, dim, fp8=fp8, device=device)
    total = num_pages * block_size
    for s0 in range(0, total, chunk):
        t = min(chunk, total - s0)
        if integer:
            keys = torch.randint(-3, 4, (t, dim), device=device, generator=generator)
        else:
            keys = torch.randn(t, dim, device=device, generator=generator) * scale
        write(keys.bfloat16(), cache, torch.arange(s0, s0 + t, device=device, dtype=torch.int64))
    return cache


def indexer_problem(
    g: torch.Generator,
    num_req: int,
    next_n: int,
    max_ctx: int,
    *,
    heads: int,
    dim: int,
    block_size: int,
    fp8: bool,
    integer: bool = False,
    key_scale: float = 1.0,
    spare_pages: int = 1,
    hostile: bool = False,
    reference_writer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``index_logits`` problem on ``g``'s device: ``(q, weights, cache, seq_lens,
    block_table)`` with ``num_req * next_n`` query rows, lengths uniform in ``[0, max_ctx]``,
    each request its own distinct pages (``spare_pages`` more in the cache than the tables
    use), keys of scale ``key_scale`` (:func:`filled_indexer_cache`, ``reference_writer``).
    ``hostile``: in a third of the problems one page id is invalid (-1 or past the cache: its
    positions score -inf), and one request's length is one of the table's capacity, 0, -5,
    past the table or the int32 maximum."""
    dev = g.device
    width = -(-max_ctx // block_size)
    pages = num_req * width + spare_pages
    kw = dict(fp8=fp8, device=dev, generator=g, integer=integer)
    cache = filled_indexer_cache(
        pages, block_size, dim, scale=key_scale, reference_writer=reference_writer, **kw
    )
    bt = distinct_block_table(pages, num_req, width, device=dev, generator=g)
    q, w = indexer_queries(num_req * next_n, heads, dim, **kw)
    lens = torch.randint(0, max_ctx + 1, (num_req,), device=dev, generator=g).int()
    if hostile:
        _hostile_indexer_entries(g, bt, lens, pages, width * block_size)
    return q, w, cache, lens, bt


def _hostile_indexer_entries(
    g: torch.Generator, bt: torch.Tensor, lens: torch.Tensor, pages: int, cap: int
) -> None:
    """One invalid page id (a third of the time) and one hostile length, in place."""

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (), generator=g, device=g.device))

    if pick(3) == 0 and bt.numel():
        bt.view(-1)[pick(bt.numel())] = (-1, pages + 5)[pick(2)]
    if len(lens):
        lens[pick(len(lens))] = (cap, 0, -5, cap + 100, 2**31 - 1)[pick(5)]


#: How :func:`expansion_decode_lens` draws the decode lengths n_b: every one the same
#: (``decode_len``, default the maximum), each uniform in [0, max], mostly CUDA-graph padding
#: (``padded``: 0 half the time, else 1 or the maximum), or hostile int32 values (negative,
#: above the maximum, the int32 extremes; a device decode-length tensor's trap).
DECODE_LEN_KINDS = ("uniform", "ragged", "padded", "hostile")
#: How :func:`expansion_inputs` draws the context lengths L_b: ``within_table``, uniform in
#: [0, ctx) (default: what the block table covers; 0 where n_b is 0, a padding request);
#: ``near_decode_len``, each one of 0, 1, [0, max n + 1] (below n_b: clamped) or [0, ctx]
#: (what DCP splits unevenly); ``at_least_decode_len``, n_b + uniform [0, ctx - n_b] (an
#: engine's step); ``hostile``, int32 extremes, negative and small values.
SEQ_LEN_KINDS = ("within_table", "near_decode_len", "at_least_decode_len", "hostile")
_HOSTILE_DECODE_LENS = (-(2**31), -5, -3, -1, 0, 1, 3, 4, 9, 100, 2**31 - 1)
_HOSTILE_SEQ_LENS = (-(2**31), -5, -3, 0, 2, 3, 40, 1000, 2**31 - 1)


def _pick(g: torch.Generator | None, values: tuple, n: int) -> torch.Tensor:
    """``n`` of ``values`` (int32), each uniformly."""
    at = torch.randint(0, len(values), (n,), generator=g)
    return torch.tensor(values, dtype=torch.int64)[at].to(torch.int32)


def expansion_decode_lens(
    g: torch.Generator | None,
    num_reqs: int,
    max_decode_len: int,
    kind: str,
    *,
    decode_len: int | None = None,
) -> list[int]:
    """Decode lengths n_b of ``num_reqs`` requests for the expansion (``expand_decode_tokens``)
    as :data:`DECODE_LEN_KINDS` says, drawn on the CPU from ``g`` (None: torch's default)."""
    if kind == "uniform":
        n = max_decode_len if decode_len is None else decode_len
        return [n] * num_reqs
    if kind == "ragged":
        return torch.randint(0, max_decode_len + 1, (num_reqs,), generator=g).tolist()
    if kind == "padded":
        return _pick(g, (0, 0, 1, max_decode_len), num_reqs).tolist()
    if kind == "hostile":
        return _pick(g, _HOSTILE_DECODE_LENS, num_reqs).tolist()
    raise ValueError(f"kind must be one of {DECODE_LEN_KINDS}, got {kind!r}")


class ExpansionInputs(NamedTuple):
    """The expansion's inputs: int32 ``seq_lens`` ``[B]`` and ``block_table`` ``[B, W]`` (a
    :func:`block_table_view`) on the device, the host ``decode_lens`` and ``total``, the
    tokens they make once each n_b is clamped to [0, max_decode_len]."""

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    decode_lens: list[int]
    total: int

    def query_start_loc(self) -> torch.Tensor:
        """The decode lengths as int32 row offsets ``[B + 1]`` on the inputs' device."""
        lens = torch.tensor([0, *self.decode_lens], dtype=torch.int64)
        return torch.cumsum(lens, 0).to(torch.int32).to(self.seq_lens.device)


def _expansion_seq_lens(
    g: torch.Generator | None, lens: torch.Tensor, kind: str, ctx: int, max_n: int
) -> torch.Tensor:
    b = len(lens)
    if kind == "within_table":
        seq = torch.randint(0, max(ctx, 1), (b,), generator=g, dtype=torch.int32)
        seq[lens == 0] = 0  # padding requests: no tokens, length 0
        return seq
    if kind == "near_decode_len":
        which = torch.randint(0, 4, (b,), generator=g)
        small = torch.randint(0, max_n + 2, (b,), generator=g)
        large = torch.randint(0, ctx + 1, (b,), generator=g)
        seq = torch.where(which == 0, 0, torch.where(which == 1, 1, small))
        return torch.where(which == 3, large, seq).to(torch.int32)
    if kind == "at_least_decode_len":
        lens = lens.clamp(0, ctx)
        extra = (torch.rand(b, generator=g) * (ctx - lens + 1).float()).long()
        return (lens + extra).to(torch.int32)
    if kind == "hostile":
        return _pick(g, _HOSTILE_SEQ_LENS, b)
    raise ValueError(f"seq_lens must be one of {SEQ_LEN_KINDS}, got {kind!r}")


def expansion_inputs(
    g: torch.Generator | None,
    decode_lens: list[int],
    *,
    width: int,
    max_decode_len: int | None = None,
    seq_lens: str = "within_table",
    ctx: int | None = None,
    block_size: int = 64,
    page_ids: int = 1 << 24,
    layout: str = "contiguous",
    device: torch.device | str = "cpu",
) -> ExpansionInputs:
    """Inputs of the decode-token expansion (``expand_decode_tokens``, the decode metadata)
    for requests of decode lengths ``decode_lens`` (:func:`expansion_decode_lens`): context
    lengths as ``seq_lens`` names (:data:`SEQ_LEN_KINDS`; ``ctx`` defaults to ``width *
    block_size`` for ``within_table``, else 600) and a block table of ``width`` random page
    ids in [0, ``page_ids``) laid out as ``layout`` (:data:`BLOCK_TABLE_LAYOUTS`). Drawn on
    the CPU from ``g`` (None: torch's default generator), in that order, then moved."""
    max_n = max(decode_lens, default=0) if max_decode_len is None else max_decode_len
    if ctx is None:
        ctx = width * block_size if seq_lens == "within_table" else 600
    lens = torch.tensor(decode_lens, dtype=torch.int64)
    seq = _expansion_seq_lens(g, lens, seq_lens, ctx, max(max_n, 0))
    pages = torch.randint(0, page_ids, (len(decode_lens), width), generator=g, dtype=torch.int32)
    total = int(lens.clamp(0, max(max_n, 0)).sum())
    table = block_table_view(pages, layout, device=device)
    return ExpansionInputs(seq.to(device), table, list(decode_lens), total)
