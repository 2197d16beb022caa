"""What every rank of the DCP tests runs (inside processes started by ``_spawn.run_ranks``).

:func:`run_all` runs every scenario once per process (starting processes is the slow part
on a CPU) and returns ``{scenario: None or why it failed}``; the tests assert per scenario.
All ranks build the same full inputs from one seed and each keeps its own shard, so every
rank can also compute the single-process answer. A scenario makes all its collective calls
first and compares afterwards, so a mismatch on one rank cannot desynchronise the others.
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist

from sparse_mla import (
    dcp,
    filter_and_convert_dcp_index,
    new_mla_cache,
    select_topk,
    sparse_mla_decode,
)
from sparse_mla.dcp import _dist
from sparse_mla.dcp.naive import (
    attention_rows_reference,
    combine_reference,
    global_topk_reference,
    local_topk_candidates_reference,
)
from sparse_mla.ops._common.dcp import dcp_owner_reference
from sparse_mla.ops.topk import MAX_K, select_topk_reference
from sparse_mla.testing import POISON, dcp_scores, dcp_shard_scores

K = 128
PAGE = 64
LATENT = 576  # the attention kernel's row: 512 nope + 64 rope
_TOPK_ROWS = 10


def _gen(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + salt)


def _topk_rows(world: int, interleave: int, gen: torch.Generator):
    """Full rows of every adversarial kind, with their global lengths (same on every rank)."""
    span = world * interleave
    n = 5 * span if interleave > 1 else 640
    few = 1 if interleave == 1 else interleave - 1  # only rank 0 owns any position
    lens = [0, few, span + 1, K, K + 1, n // 2, n, n, n, n]
    assert len(lens) == _TOPK_ROWS
    kinds = ["normal", "ties", "ties", "special", "normal", "ties", "normal", "special"]
    logits = torch.cat([dcp_scores(1, n, kind=kd, generator=gen) for kd in kinds + ["ties"] * 2])
    logits[-2, :] = 1.0  # one score for the whole row: the lowest positions win
    # Last row: every position rank 0 owns outscores all others, and rank 0 owns more than
    # k positions, so the exact top-k lies on rank 0 alone (the union mode's difference).
    owner = dcp_owner_reference(torch.arange(n), world, interleave)
    logits[-1] = torch.where(owner == 0, 10.0, 0.0) + torch.rand(n, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return logits, seq_lens, owner


def _check_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if (got == POISON).any():
        return f"{name}: poison left in the output"
    if not torch.equal(got, want):
        bad = (got != want).any(1).nonzero().flatten().tolist()
        r = bad[0]
        return f"{name}: rows {bad} differ; row {r}: got {got[r].tolist()} want {want[r].tolist()}"
    return None


def _joined(errs: list) -> str | None:
    return "; ".join(e for e in errs if e) or None


_WORKSPACES: dict[int, dcp.GlobalTopkWorkspace] = {}


def _workspace(world: int) -> dcp.GlobalTopkWorkspace:
    if world not in _WORKSPACES:
        _WORKSPACES[world] = dcp.global_topk_workspace(_TOPK_ROWS, k=K, dcp_size=world)
    return _WORKSPACES[world]


def topk(group, rank: int, world: int, seed: int, interleave: int) -> dict[str, str | None]:
    """Exact mode against single-GPU select_topk over the full rows, and the union mode."""
    logits, seq_lens, owner = _topk_rows(world, interleave, _gen(seed, interleave))
    local, local_lens = dcp_shard_scores(
        logits, seq_lens, dcp_size=world, dcp_rank=rank, interleave=interleave
    )
    rows, n_local = local.shape
    kw = dict(k=K, dcp_size=world, dcp_rank=rank, interleave=interleave, group=group)
    # A strided view of the scores, a strided output buffer, and one workspace for every
    # call of the process (reused from the second scenario on).
    wide = torch.full((rows, n_local + 3), float("nan"))
    wide[:, 1 : 1 + n_local] = local
    big = torch.full((rows, K + 7), POISON, dtype=torch.int32)
    out = big[:, 3 : 3 + K]
    got = dcp.global_topk(
        wide[:, 1 : 1 + n_local], local_lens, out=out, workspace=_workspace(world), **kw
    )
    union = dcp.global_topk(local, local_lens, mode="union", **kw)

    want = select_topk_reference(logits, seq_lens, K)
    shards = [
        dcp_shard_scores(logits, seq_lens, dcp_size=world, dcp_rank=r, interleave=interleave)
        for r in range(world)
    ]
    naive = global_topk_reference(
        [s[0] for s in shards], [s[1] for s in shards], K, interleave=interleave
    )
    exact_errs = [
        _check_equal("global_topk", got, want),
        _check_equal("naive global_topk_reference", naive, want),
        None if got.data_ptr() == out.data_ptr() else "global_topk did not return out",
    ]
    if rank == 0:  # the single-GPU kernel over the full rows (once: it is the slow part)
        exact_errs.append(_check_equal("select_topk", select_topk(logits, seq_lens, k=K), want))

    _, local_want = local_topk_candidates_reference(
        local, local_lens, K, dcp_rank=rank, dcp_size=world, interleave=interleave
    )
    union_errs = [_check_equal("union vs this rank's local top-k", union, local_want)]
    for t in range(rows):
        ex = set(want[t][want[t] >= 0].tolist())
        mine = {p for p in ex if int(owner[p]) == rank}
        missing = mine - set(union[t].tolist())
        if missing:  # the exactness lemma: the rank's share of the top-k is in its union
            union_errs.append(f"row {t}: exact positions owned here {sorted(missing)} not in union")
    ex, un = set(want[-1].tolist()), set(union[-1].tolist())
    if rank == 0 and un != ex:
        union_errs.append("last row: rank 0's union should equal the exact top-k")
    if rank > 0 and (un & ex or -1 in un):
        union_errs.append("last row: rank > 0's union should be k of its own, none exact")
    return {
        f"topk_exact_i{interleave}": _joined(exact_errs),
        f"topk_union_i{interleave}": _joined(union_errs),
    }


def _combine_inputs(world: int, gen: torch.Generator, t: int = 6, h: int = 8, d: int = 40):
    outs = torch.randn(world, t, h, d, generator=gen)
    lses = 3 * torch.randn(world, t, h, generator=gen)
    lses[1:, 0] = float("-inf")  # row 0: only rank 0 has tokens
    lses[:, 1] = float("-inf")  # row 1: no rank has any (a padding row)
    lses[0, 2, ::2] = float("-inf")  # row 2: rank 0 has nothing for even heads
    lses[-1, 3, 0] = 80.0  # row 3: one rank dominates one head
    outs = torch.where(torch.isinf(lses)[..., None], float("nan"), outs)  # never read
    return outs, lses


def _invalid_lses(outs: torch.Tensor, lses: torch.Tensor):
    """The same inputs with NaN lses (a NaN attention row) at a few (rank, row, head) and a
    +inf one (FlashMLA's empty marker) where the rank saw nothing; returns (outs, lses, the
    (row, head) whose merge must be NaN: bool [T, H])."""
    outs, lses = outs.clone(), lses.clone()
    lses[-1, 4, 1] = float("nan")  # its out finite
    lses[0, 4, 6] = float("nan")
    outs[0, 4, 6] = float("nan")
    lses[1, 0, 5] = float("nan")  # beside the only rank that saw row 0
    lses[0, 1, 2] = float("nan")  # a row no other rank saw
    lses[1, 0, 4] = float("inf")  # empty, as FlashMLA marks it (rank 1 saw nothing of row 0)
    lses[:, 5, 7] = float("nan")  # every rank
    return outs, lses, torch.isnan(lses).any(0)


def _check_close(name: str, got, want, *, atol: float, rtol: float) -> str | None:
    got = got.float()
    if torch.isnan(got).any():
        return f"{name}: {int(torch.isnan(got).sum())} NaN"
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return f"{name}: -inf pattern differs"
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs()
    tol = atol + rtol * want[fin].abs()
    if not torch.all(err <= tol):
        return f"{name}: max err / tol {float((err / tol).max()):.3g}"
    return None


def _check_nan_only_at(name: str, got, clean, nan_at: torch.Tensor) -> str | None:
    """``got`` NaN exactly where ``nan_at`` (a [T, H] mask, broadcast over D), elsewhere bit for
    bit ``clean``."""
    mask = nan_at if got.dim() == 2 else nan_at[..., None].expand(got.shape)
    nan = torch.isnan(got.float())
    if not torch.equal(nan, mask):
        at = (nan if nan.dim() == 2 else nan.any(-1)).nonzero().tolist()
        return f"{name}: NaN at (row, head) {at} (not all of D?), want {nan_at.nonzero().tolist()}"
    if not torch.equal(got[~mask], clean[~mask]):
        return f"{name}: values without an invalid lse changed"
    return None


def combine_cases(group, rank: int, world: int, seed: int) -> str | None:
    outs, lses = _combine_inputs(world, _gen(seed, 3))
    bad_outs, bad_lses, nan_at = _invalid_lses(outs, lses)
    heads = outs.shape[2]
    hs = slice(rank * heads // world, (rank + 1) * heads // world)
    errs = []
    cases = [
        ("all_reduce", torch.float32, None),
        ("reduce_scatter_heads", torch.float32, None),
        ("all_reduce", torch.bfloat16, None),
        ("reduce_scatter_heads", torch.bfloat16, torch.float32),
    ]
    results = []
    for reduce, dtype, sum_dtype in cases:
        got = []
        for o, s in ((outs, lses), (bad_outs, bad_lses)):
            mine = o[rank].to(dtype)
            heads_here = heads // world if reduce != "all_reduce" else heads
            shape = (mine.shape[0], heads_here, mine.shape[2])
            buf = None if sum_dtype is None else torch.empty(shape, dtype=sum_dtype)
            lse_view = s[rank].t().contiguous().t()  # a strided lse
            got.append(dcp.combine(mine, lse_view, group=group, reduce=reduce, out_buffer=buf))
        results.append((reduce, dtype, sum_dtype, *got))
    for reduce, dtype, sum_dtype, (got_out, got_lse), (bad_out, bad_lse) in results:
        name = f"combine {reduce} {dtype} (sum in {sum_dtype or dtype})"
        want_out, want_lse = combine_reference(outs.to(dtype), lses)
        ref_bad_out, ref_bad_lse = combine_reference(bad_outs.to(dtype), bad_lses)
        nan_out = nan_at
        if reduce != "all_reduce":
            want_out, ref_bad_out, nan_out = want_out[:, hs], ref_bad_out[:, hs], nan_at[:, hs]
        # The reference sums the same (bf16) inputs in fp64: an fp32 sum is off by fp32
        # rounding; a bf16 one rounds each weighted part and each partial sum to bf16.
        fp32_sum = (sum_dtype or dtype) == torch.float32
        atol = 1e-5 if fp32_sum else world * 2.0**-7
        errs.append(_check_close(name + " out", got_out, want_out, atol=atol, rtol=atol))
        errs.append(_check_close(name + " lse", got_lse, want_lse, atol=1e-5, rtol=1e-6))
        # A NaN or +inf lse on any rank: NaN there, everything else as without it.
        errs.append(_check_nan_only_at(name + " NaN-lse out", bad_out, got_out, nan_out))
        errs.append(_check_nan_only_at(name + " NaN-lse lse", bad_lse, got_lse, nan_at))
        errs.append(_check_nan_only_at("reference NaN-lse out", ref_bad_out, want_out, nan_out))
        errs.append(_check_nan_only_at("reference NaN-lse lse", ref_bad_lse, want_lse, nan_at))
    return _joined(errs)


def attention(group, rank: int, world: int, seed: int, interleave: int) -> str | None:
    """The whole decode step: global top-k, this rank's filter + localise + remap of the
    selection through its block table, attention over its shard, combine; against attention
    over the full cache with the single-GPU selection."""
    gen = _gen(seed, 50 + interleave)
    heads, dk, dv, n = 4, 48, 32, 640
    req_lens = [n, 50]  # request 1 is shorter than one interleave group (I=64)
    req_id = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32)
    seq_lens = torch.tensor([n - 1, n, 49, 50, 0], dtype=torch.int32)  # last: padding row
    rows = req_id.numel()
    logits = dcp_scores(rows, n, kind="ties", generator=gen)
    kv = torch.randn(len(req_lens), n, dk, generator=gen)  # [request, position, Dk]
    q = torch.randn(rows, heads, dk, generator=gen)
    scale = dk**-0.5

    # This rank's paged cache: its local positions of each request, pages in random order.
    owner = dcp_owner_reference(torch.arange(n), world, interleave)
    mine = torch.arange(n)[owner == rank]
    pages = -(-mine.numel() // PAGE)
    order = torch.randperm(len(req_lens) * pages, generator=gen).to(torch.int32)
    block_table = order.view(len(req_lens), pages)
    cache = torch.zeros(len(req_lens) * pages * PAGE, dk)
    for r in range(len(req_lens)):
        local = torch.arange(mine.numel())
        slots = block_table[r, local // PAGE].long() * PAGE + local % PAGE
        cache[slots] = kv[r, mine]

    local_logits, local_lens = dcp_shard_scores(
        logits, seq_lens, dcp_size=world, dcp_rank=rank, interleave=interleave
    )
    kw = dict(dcp_size=world, dcp_rank=rank, interleave=interleave)
    topk = dcp.global_topk(local_logits, local_lens, k=K, group=group, **kw)
    local_slots = filter_and_convert_dcp_index(req_id, block_table, topk, block_size=PAGE, **kw)
    part_out, part_lse = attention_rows_reference(q, cache, local_slots, sm_scale=scale, v_dim=dv)
    got_out, got_lse = dcp.combine(part_out, part_lse, group=group)

    want_topk = select_topk_reference(logits, seq_lens, K)
    flat = torch.where(want_topk >= 0, req_id[:, None] * n + want_topk, -1)
    want_out, want_lse = attention_rows_reference(
        q, kv.view(-1, dk), flat, sm_scale=scale, v_dim=dv
    )
    errs = [
        _check_equal("global top-k", topk, want_topk),
        _check_close("attention out", got_out, want_out, atol=1e-5, rtol=1e-5),
        _check_close("attention lse", got_lse, want_lse, atol=1e-5, rtol=1e-6),
    ]

    if world != 2:  # the kernel runs in the interpreter: once, on 2 ranks, is enough on CPUs
        return _joined(errs)
    # The same step through the library's attention kernel: 576-dim latent rows in a bf16
    # cache, the compacted local rows read up to their valid counts.
    kv = torch.randn(len(req_lens), n, LATENT, generator=gen).bfloat16()
    q = torch.randn(rows, heads, LATENT, generator=gen).bfloat16()
    cache = new_mla_cache(len(req_lens) * pages, PAGE, fp8=False)
    flat_cache = cache.view(-1, LATENT)
    for r in range(len(req_lens)):
        local = torch.arange(mine.numel())
        slots = block_table[r, local // PAGE].long() * PAGE + local % PAGE
        flat_cache[slots] = kv[r, mine]
    local_slots, counts = filter_and_convert_dcp_index(
        req_id, block_table, topk, block_size=PAGE, return_valid_counts=True, **kw
    )
    scale = LATENT**-0.5
    part_out, part_lse = sparse_mla_decode(
        q, cache, local_slots, sm_scale=scale, topk_length=counts
    )
    summed = torch.empty(rows, heads, 512, dtype=torch.float32)
    got_out, got_lse = dcp.combine(part_out, part_lse, group=group, out_buffer=summed)
    want_out, want_lse = attention_rows_reference(
        q.float(), kv.view(-1, LATENT).float(), flat, sm_scale=scale, v_dim=512
    )
    # Each rank's out is bf16 (2^-9 relative) and its softmax weights feed a bf16 dot.
    errs += [
        _check_close("kernel attention out", got_out, want_out, atol=2e-2, rtol=2e-2),
        _check_close("kernel attention lse", got_lse, want_lse, atol=1e-4, rtol=1e-5),
    ]
    return _joined(errs)


def _raises(name: str, fn, *, needle: str, calls: list) -> str | None:
    before = len(calls)
    try:
        fn()
    except (ValueError, TypeError) as e:
        if needle not in str(e):
            return f"{name}: message {str(e)!r} does not name {needle!r}"
        if len(calls) != before:
            return f"{name}: raised after a collective"
        return None
    return f"{name}: no error raised"


def errors(group, rank: int, world: int, seed: int) -> str | None:
    """Bad arguments raise on every rank before any collective (counted by wrapping them)."""
    calls: list = []
    real_ag, real_rs = _dist._all_gather, _dist._reduce_scatter
    _dist._all_gather = lambda *a, **k: (calls.append("ag"), real_ag(*a, **k))[1]
    _dist._reduce_scatter = lambda *a, **k: (calls.append("rs"), real_rs(*a, **k))[1]
    try:
        return _error_cases(group, rank, world, calls)
    finally:
        _dist._all_gather, _dist._reduce_scatter = real_ag, real_rs


def _error_cases(group, rank: int, world: int, calls: list) -> str | None:
    x = torch.randn(3, 200)
    lens = torch.full((3,), 150, dtype=torch.int32)
    good = dict(k=K, dcp_size=world, dcp_rank=rank, interleave=1, group=group)

    def topk(x=x, lens=lens, **over):
        return lambda: dcp.global_topk(x, lens, **{**good, **over})

    out, lse = torch.randn(3, 8, 16), torch.randn(3, 8)

    def comb(out=out, lse=lse, **over):
        return lambda: dcp.combine(out, lse, **{"group": group, **over})

    ws_other = dcp.global_topk_workspace(3, k=K, dcp_size=world + 1)
    scatter = "reduce_scatter_heads"
    cases = [
        ("group not a group", topk(group="world"), "group"),
        ("dcp_rank out of range", topk(dcp_rank=world), "dcp_rank"),
        ("dcp_rank negative", topk(dcp_rank=-1), "dcp_rank"),
        ("dcp_rank not this rank", topk(dcp_rank=(rank + 1) % world), "dcp_rank"),
        ("dcp_size != group size", topk(dcp_size=world + 1), "dcp_size"),
        ("k zero", topk(k=0), "k"),
        ("k too large", topk(k=MAX_K + 1), "k"),
        ("interleave 0", topk(interleave=0), "interleave"),
        ("mode", topk(mode="approx"), "mode"),
        ("seq_lens shape", topk(lens=lens[:2]), "local_seq_lens"),
        ("logits dtype", topk(x=x.half()), "local_logits"),
        ("out shape", topk(out=torch.empty(3, 64, dtype=torch.int32)), "out"),
        ("workspace sizes", topk(workspace=ws_other), "workspace"),
        ("combine group", comb(group=None), "group"),
        ("combine lse shape", comb(lse=lse[:, :4]), "lse"),
        ("combine reduce", comb(reduce="sum"), "reduce"),
        (
            "combine heads",
            comb(out=out[:, :3], lse=lse[:, :3], reduce=scatter),
            "heads",
        ),
        ("combine out_buffer", comb(out_buffer=torch.empty(3, 8, 8)), "out_buffer"),
    ]
    errs = [_raises(name, fn, needle=needle, calls=calls) for name, fn, needle in cases]
    # Every rank is still in step: a real call afterwards completes on all of them.
    dcp.global_topk(x, lens, **good)
    dist.barrier(group=group)
    return _joined(errs)


# (the result names a scenario returns, the scenario); a dict return maps name -> result.
SCENARIOS = [
    (("topk_exact_i1", "topk_union_i1"), lambda g, r, w, s: topk(g, r, w, s, 1)),
    (("topk_exact_i64", "topk_union_i64"), lambda g, r, w, s: topk(g, r, w, s, 64)),
    (("combine",), combine_cases),
    (("attention_i1",), lambda g, r, w, s: attention(g, r, w, s, 1)),
    (("attention_i64",), lambda g, r, w, s: attention(g, r, w, s, 64)),
    (("errors",), errors),
]


def run_all(group, rank: int, world: int, seed: int) -> dict[str, str | None]:
    """Every scenario on this rank: {result name: None, or why it failed}."""
    results = {}
    for names, fn in SCENARIOS:
        start = time.perf_counter()
        try:
            got = fn(group, rank, world, seed)
            results.update(got if isinstance(got, dict) else {names[0]: got})
        except Exception:
            results.update(dict.fromkeys(names, traceback.format_exc()))
        if os.environ.get("SPARSE_MLA_DCP_TIMES"):
            print(f"rank {rank} {names[0]}: {time.perf_counter() - start:.1f} s", flush=True)
    return results
