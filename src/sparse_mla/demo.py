"""``sparse-mla demo``: the main job.

1. A short worked example of the metadata and remap kernels beside the plain PyTorch
   reference (tiny inputs you can check by hand).
2. The indexer side of one DeepSeek-V3.2 (DSA) decode step on a synthetic batch, every stage
   checked against its reference: ragged speculative-decode (MTP) requests with CUDA-graph
   padding, paged caches filled by the writers (indexer K bf16 and fp8, MLA latent fp8),
   decode metadata in flattened and native form, index logits, exact top-k, remap to global
   slots (and the fused top-k epilogue), and the DCP filter over two ranks. A table lists each
   stage's shape, time (GPU: median of CUDA-event-timed runs; CPU: the interpreter's wall
   time) and verdict. Integer stages must match bit for bit; logits match the fp64 reference
   within the tolerance of ``tests/ops/test_indexer.py``.
3. The quick verification sweep (``sparse-mla verify --quick``), unless ``--skip-verify``.

Sizes: ``--size small`` (the default on the CPU interpreter) or ``--size v32`` (the default on
a GPU: 64 heads x 128 dims, page 64, k 2048, 32 requests, contexts up to 128K). The process
exits non-zero when any check fails; the last line says PASS or FAIL.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ._runtime import default_device, info
from .ops.decode_metadata import (
    DecodeMetadataBuilder,
    dcp_local_seq_lens,
    expand_decode_tokens,
)
from .ops.decode_metadata.naive import (
    dcp_local_len,
    expand_decode_tokens_reference,
    native_decode_seq_lens_reference,
)
from .ops.indexer import index_logits, index_logits_reference
from .ops.indexer.logits import MAX_NEXT_N
from .ops.kv_cache import new_indexer_k_cache, new_mla_cache, write_indexer_k, write_mla_latent
from .ops.kv_cache.naive import write_indexer_k_reference, write_mla_latent_reference
from .ops.remap import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .ops.remap.naive import convert_req_index_to_global_index_reference
from .ops.topk import (
    positions_to_slots_reference,
    select_topk,
    select_topk_reference,
    topk_workspace,
)
from .testing import logits_tolerance


def _show(name: str, t: torch.Tensor) -> None:
    print(f"  {name:14} {t.cpu().tolist()}")


def _verdict(ok: bool) -> str:
    return "OK (matches reference)" if ok else "MISMATCH"


def worked_examples() -> bool:
    dev = default_device()
    i32 = dict(dtype=torch.int32, device=dev)
    ok_all = True

    print("\n1. Speculative-decode expansion, ragged: L=[10,7,12,0], n=[3,1,4,0], 2 pad rows")
    seq_lens = torch.tensor([10, 7, 12, 0], **i32)
    block_table = torch.tensor([[10, 11], [20, 21], [30, 31], [40, 41]], **i32)
    exp = expand_decode_tokens(seq_lens, block_table, [3, 1, 4, 0], max_decode_len=4, num_tokens=10)
    _show("seq_lens", exp.seq_lens)
    _show("req_id", exp.req_id)
    _show("block_table", exp.block_table)
    ok = exp.seq_lens.cpu().tolist() == [8, 9, 10, 7, 9, 10, 11, 12, 0, 0]
    print(f"  -> {_verdict(ok)}")
    ok_all &= ok

    print("\n2. DCP localisation after expansion: world 2, rank 1, lengths [8,9,10]")
    local = dcp_local_seq_lens(torch.tensor([8, 9, 10], **i32), dcp_size=2, dcp_rank=1)
    _show("local lens", local)
    ok = local.cpu().tolist() == [4, 4, 5]
    print(f"  -> {_verdict(ok)}")
    ok_all &= ok

    print("\n3. Index remap, page 4: slot = block_table[req, i // 4] * 4 + i % 4")
    req_id = torch.tensor([0, 1], **i32)
    bt = torch.tensor([[7, 3], [5, 9]], **i32)
    idx = torch.tensor([[0, 5, 7, -1, 8, 2], [6, -1, 1, 4, 3, 99]], **i32)
    out, counts = convert_req_index_to_global_index(
        req_id, bt, idx, block_size=4, return_valid_counts=True
    )
    ref, ref_counts = convert_req_index_to_global_index_reference(
        req_id.cpu(), bt.cpu(), idx.cpu(), block_size=4, return_valid_counts=True
    )
    _show("token_indices", idx)
    _show("slots", out)
    _show("valid_counts", counts)
    ok = torch.equal(out.cpu(), ref) and torch.equal(counts.cpu(), ref_counts)
    print(f"  -> {_verdict(ok)}")
    ok_all &= ok

    print("\n4. DCP filter + compaction, world 2, rank 1, interleave 1 (same inputs)")
    out, counts = filter_and_convert_dcp_index(
        req_id, bt, idx, dcp_size=2, dcp_rank=1, block_size=4, return_valid_counts=True
    )
    ref = convert_req_index_to_global_index_reference(
        req_id.cpu(), bt.cpu(), idx.cpu(), block_size=4, dcp_size=2, dcp_rank=1, compact=True
    )
    _show("slots", out)
    _show("valid_counts", counts)
    ok = torch.equal(out.cpu(), ref)
    print(f"  -> {_verdict(ok)}")
    return ok_all and ok


# ---- the indexer side of one DSA decode step -------------------------------------------------


@dataclass(frozen=True)
class DemoSize:
    """Shapes of the synthetic batch.

    ``requests`` real decode requests with ``n_b`` in ``1..max_decode_len`` query tokens and
    contexts log-uniform in ``[min_context, max_context]`` (the first one at the maximum), plus
    ``padding_requests`` CUDA-graph padding requests (``L = 0``); the flattened token count is
    rounded up to a multiple of ``graph_bucket`` (padding rows). The indexer has ``heads`` x
    ``head_dim``; the KV cache has pages of ``page`` tokens; top-k keeps ``k``.
    """

    name: str
    requests: int
    padding_requests: int
    min_context: int
    max_context: int
    heads: int
    head_dim: int
    page: int
    k: int
    max_decode_len: int = 4
    uniform_n: int = 2
    graph_bucket: int = 8
    dcp_interleave: int = 1
    timing_reps: int = 20


SIZES = {
    # The CPU interpreter: small enough for well under a minute.
    "small": DemoSize("small", 8, 2, 200, 2048, 16, 64, 64, 256),
    # DeepSeek-V3.2 shapes: 64 x 128 indexer, page 64, k 2048, contexts up to 128K.
    "v32": DemoSize("v32", 32, 2, 4096, 131072, 64, 128, 64, 2048),
}


@dataclass
class Stage:
    """One row of the stage table."""

    name: str
    shape: str
    time: str
    ok: bool
    verdict: str


class _Timer:
    """Runs a stage once for its result; on a GPU then times it (median of CUDA-event-timed
    repetitions, every stage is idempotent), on the CPU reports the interpreter's wall time."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.cuda = device.type == "cuda"
        self.reps = reps

    def __call__(self, fn):
        if not self.cuda:
            t0 = time.perf_counter()
            res = fn()
            return res, f"{(time.perf_counter() - t0) * 1e3:.0f} ms interp"
        res = fn()
        torch.cuda.synchronize()
        fn()  # warm (first call compiled)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.reps)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in events)
        return res, f"{ms * 1e3:.1f} us"


def _shape(*ts: torch.Tensor) -> str:
    return " ".join("[" + ",".join(str(d) for d in t.shape) + "]" for t in ts)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _exact(ok: bool, what: str = "bit-exact vs reference") -> tuple[bool, str]:
    return ok, (what if ok else "MISMATCH vs reference")


def _logits_verdict(
    got: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    bt: torch.Tensor,
    **kw,
) -> tuple[bool, str]:
    """Against the fp64 reference: -inf exactly where the reference has it, elsewhere within
    ``sparse_mla.testing.logits_tolerance``."""
    ref = index_logits_reference(q, w, cache, lens, bt, **kw)
    mag = index_logits_reference(q, w, cache, lens, bt, magnitude=True, **kw)
    got = got.double()
    if got.shape != ref.shape or torch.isnan(got).any():
        return False, "shape or NaN"
    if not torch.equal(torch.isneginf(got), torch.isneginf(ref)):
        return False, "-inf pattern differs"
    fin = torch.isfinite(ref)
    heads, dim = q.shape[1], q.shape[2]
    fp8 = q.dtype == torch.float8_e4m3fn
    tol = logits_tolerance(mag[fin], heads=heads, dim=dim, fp8=fp8, device=got.device)
    err = (got[fin] - ref[fin]).abs()
    ratio = (err / tol.clamp_min(1e-300)).max().item() if err.numel() else 0.0
    ok = bool(torch.all(err <= tol))
    return ok, f"{'within' if ok else 'OUT OF'} tolerance (max err/tol {ratio:.2g}), -inf exact"


def _quantize_q(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 indexer queries as V3.2 runs them: one scale per (token, head), folded into the
    head weights (power of two, so the fold is exact)."""
    amax = q.float().abs().amax(dim=-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q8 = (q.float() / scale[..., None]).to(torch.float8_e4m3fn)
    return q8, w * scale


class _Batch:
    """The synthetic decode batch: lengths, the paged block table, this step's tokens."""

    def __init__(self, size: DemoSize, g: torch.Generator) -> None:
        r, p = size.requests, size.padding_requests
        u = torch.rand(r, generator=g, dtype=torch.float64)
        lens = (size.min_context * (size.max_context / size.min_context) ** u).round().long()
        lens[0] = size.max_context
        if r > 1:  # a short request: top-k keeps all of its positions, then -1
            lens[-1] = max(size.k // 2, size.max_decode_len)
        n = torch.randint(1, size.max_decode_len + 1, (r,), generator=g)
        n[: min(r, size.max_decode_len)] = torch.arange(1, min(r, size.max_decode_len) + 1)
        self.seq_lens = torch.cat([lens, torch.zeros(p, dtype=torch.long)]).int()
        self.decode_lens = [int(v) for v in n.tolist()] + [0] * p
        self.num_requests = r + p
        self.total = sum(self.decode_lens)
        b = size.graph_bucket
        self.num_tokens = -(-self.total // b) * b + (b if self.total % b == 0 else 0)
        self.width = -(-size.max_context // size.page)
        self.block_table, self.num_pages, _ = _page_table(
            self.seq_lens.tolist(), self.width, size.page, g
        )


def _page_table(
    lens: list[int], width: int, page: int, g: torch.Generator
) -> tuple[torch.Tensor, int, list[int]]:
    """int32 [B, width] block table of requests of the given lengths: each request gets
    ``ceil(L / page)`` distinct pages of a shuffled pool (3 spare pages), unused columns 0.
    Returns the table, the pool size and the pages used by each request."""
    need = [-(-v // page) for v in lens]
    pool = sum(need) + 3
    perm = torch.randperm(pool, generator=g).int()
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, m in enumerate(need):
        bt[b, :m] = perm[at : at + m]
        at += m
    return bt, pool, need


def _positions(counts: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of ``counts[b]`` consecutive positions from ``offsets[b]``."""
    req = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(int(counts.sum())) - starts[req] + offsets[req]
    return req, pos


def _slots(bt: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    return (bt[req, pos // page].long() * page + pos % page).to(torch.int64)


def decode_step(size: DemoSize, seed: int = 0, *, log=print) -> list[Stage]:
    """The indexer side of one DSA decode step on a synthetic batch, every stage checked.

    Returns the stage table (``all(s.ok for s in stages)`` is the verdict). A stage that
    raises ends the pipeline with a failing row.
    """
    dev = default_device()
    stages: list[Stage] = []
    try:
        _decode_step(size, seed, dev, stages, log)
    except _StageRaised:
        pass  # recorded as the failing stage's row
    except Exception as e:  # set-up between stages
        stages.append(Stage("(set-up)", "-", "-", False, f"raised {type(e).__name__}: {e}"))
    return stages


class _StageRaised(Exception):
    """A stage raised: its row is recorded and the pipeline stops."""


def _decode_step(size: DemoSize, seed: int, dev: torch.device, stages: list[Stage], log) -> None:
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=dev).manual_seed(seed + 1)  # bulk data, drawn on the device
    timer = _Timer(dev, size.timing_reps)
    batch = _Batch(size, g)
    page, k, heads, dim = size.page, size.k, size.heads, size.head_dim
    real = size.requests
    lens_h, n_h = batch.seq_lens, batch.decode_lens
    B, T, W = batch.num_requests, batch.num_tokens, batch.width
    max_len = W * page

    def stage(name: str, shape: str, fn, check, timed: bool = True) -> object:
        try:
            res, t = timer(fn) if timed else (fn(), "-")
            ok, verdict = check(res)
        except Exception as e:  # a crash fails this stage and ends the pipeline
            stages.append(Stage(name, shape, "-", False, f"raised {type(e).__name__}: {e}"))
            raise _StageRaised from e
        stages.append(Stage(name, shape, t, ok, verdict))
        return res

    log(
        f"batch: {real} requests + {size.padding_requests} CUDA-graph padding requests (L=0); "
        f"{batch.total} query tokens padded to {T} rows; page {page}, {W} pages/request max, "
        f"{batch.num_pages} pages; indexer {heads} heads x {dim}; k={k}"
    )
    if real <= 8:
        log(f"  L = {lens_h.tolist()}")
        log(f"  n = {n_h}")
    else:
        ctx = lens_h[:real].float()
        log(
            f"  L: {int(ctx.min())}..{int(ctx.max())} (mean {ctx.mean():.0f}); "
            f"n in 1..{size.max_decode_len}: {Counter(n_h[:real])}"
        )

    seq_lens = lens_h.to(dev)
    bt = batch.block_table.to(dev)
    i32 = dict(dtype=torch.int32, device=dev)

    # ---- metadata: the builder chooses flattened (ragged) or native (uniform) ----
    builder = DecodeMetadataBuilder(
        max_num_tokens=max(T, B * size.uniform_n),
        max_num_requests=B,
        max_blocks_per_req=W,
        max_decode_len=size.max_decode_len,
        # Every n index_logits takes natively (it reads a request's keys once for all n).
        native_decode_lens=range(1, min(MAX_NEXT_N, size.max_decode_len) + 1),
        device=dev,
    )
    ref_exp = expand_decode_tokens_reference(
        lens_h, batch.block_table, n_h, max_decode_len=size.max_decode_len, num_tokens=T
    )

    def check_flat(md):
        ok = md.flattened and all(
            torch.equal(getattr(md, f).cpu(), getattr(ref_exp, f))
            for f in ("seq_lens", "block_table", "decode_lens", "req_id")
        )
        return _exact(ok, "flattened; bit-exact vs reference")

    md = stage(
        "metadata: ragged -> flattened",
        f"[{T}] [{T},{W}]",
        lambda: builder.build(seq_lens, bt, n_h, num_tokens=T),
        check_flat,
    )

    # Per-token lengths localised to each of 2 DCP ranks (after expansion).
    dcp_builders = [
        DecodeMetadataBuilder(
            T,
            B,
            W,
            size.max_decode_len,
            dcp_size=2,
            dcp_rank=rank,
            interleave=size.dcp_interleave,
            device=dev,
        )
        for rank in range(2)
    ]

    def dcp_lens():
        return [b.build(seq_lens, bt, n_h, num_tokens=T).seq_lens for b in dcp_builders]

    def check_dcp_lens(local):
        ok = True
        for rank in range(2):
            want = expand_decode_tokens_reference(
                lens_h,
                batch.block_table,
                n_h,
                max_decode_len=size.max_decode_len,
                num_tokens=T,
                dcp_size=2,
                dcp_rank=rank,
                interleave=size.dcp_interleave,
            ).seq_lens
            ok &= torch.equal(local[rank].cpu(), want)
        ok &= torch.equal((local[0] + local[1]).cpu(), ref_exp.seq_lens)
        return _exact(ok, "bit-exact; rank 0 + rank 1 = global")

    stage("metadata: DCP-local lengths, 2 ranks", f"2 x [{T}]", dcp_lens, check_dcp_lens)

    # ---- caches: history filled by the writers, then this step's tokens ----
    hist_req, hist_pos = _positions(
        (lens_h[:real] - torch.tensor(n_h[:real])).long(), torch.zeros(real, dtype=torch.long)
    )
    hist_slots = _slots(batch.block_table, hist_req, hist_pos, page).to(dev)
    step_slots = torch.full((T,), -1, dtype=torch.int64)
    tok_req = ref_exp.req_id[: batch.total].long()
    tok_pos = ref_exp.seq_lens[: batch.total].long() - 1  # the token's own position
    step_slots[: batch.total] = _slots(batch.block_table, tok_req, tok_pos, page)
    step_slots = step_slots.to(dev)  # CUDA-graph padding rows: -1, skipped
    nh = len(hist_req)
    k_hist = torch.randn(nh, dim, generator=gd, device=dev).bfloat16()
    k_step = torch.randn(T, dim, generator=gd, device=dev).bfloat16()
    kv_hist = torch.randn(nh, 576, generator=gd, device=dev).bfloat16()
    kv_step = torch.randn(T, 576, generator=gd, device=dev).bfloat16()

    caches = {}
    for fp8 in (False, True):
        name, short = ("fp8 132 B", "fp8") if fp8 else ("bf16", "bf16")
        cache = new_indexer_k_cache(batch.num_pages, page, dim, fp8=fp8, device=dev)
        ref = cache.clone()
        write_indexer_k_reference(k_hist, ref, hist_slots)
        stage(
            f"cache fill: indexer K {name}",
            _shape(k_hist),
            lambda c=cache: write_indexer_k(k_hist, c, hist_slots),
            lambda c, r=ref: _exact(_bits_equal(c, r), "bytes equal PyTorch writer"),
        )
        write_indexer_k_reference(k_step, ref, step_slots)
        stage(
            f"step write: indexer K {short} (pad -1)",
            _shape(k_step),
            lambda c=cache: write_indexer_k(k_step, c, step_slots),
            lambda c, r=ref: _exact(_bits_equal(c, r), "bytes equal PyTorch writer"),
        )
        caches[fp8] = cache
    mla = new_mla_cache(batch.num_pages, page, fp8=True, device=dev)
    mla_ref = mla.clone()
    write_mla_latent_reference(kv_hist[:, :512], kv_hist[:, 512:], mla_ref, hist_slots)
    stage(
        "cache fill: MLA latent fp8 656 B",
        _shape(kv_hist),
        lambda: write_mla_latent(kv_hist[:, :512], kv_hist[:, 512:], mla, hist_slots),
        lambda c: _exact(_bits_equal(c, mla_ref), "bytes equal PyTorch writer"),
    )
    write_mla_latent_reference(kv_step[:, :512], kv_step[:, 512:], mla_ref, step_slots)
    stage(
        "step write: MLA latent fp8 (pad -1)",
        _shape(kv_step),
        lambda: write_mla_latent(kv_step[:, :512], kv_step[:, 512:], mla, step_slots),
        lambda c: _exact(_bits_equal(c, mla_ref), "bytes equal PyTorch writer"),
    )

    # ---- index logits over the flattened rows (bf16 and fp8 caches) ----
    q = torch.randn(T, heads, dim, generator=gd, device=dev).bfloat16()
    w = torch.randn(T, heads, generator=gd, device=dev) * (heads * dim) ** -0.5
    q8, w8 = _quantize_q(q, w)
    logits = {}
    for fp8 in (False, True):
        qq, ww = (q8, w8) if fp8 else (q, w)
        buf = torch.empty(T, max_len, device=dev)
        logits[fp8] = stage(
            f"logits {'fp8' if fp8 else 'bf16'}, flattened",
            _shape(buf),
            lambda qq=qq, ww=ww, c=caches[fp8], buf=buf: index_logits(
                qq, ww, c, md.seq_lens, md.block_table, max_len=max_len, out=buf
            ),
            lambda res, qq=qq, ww=ww, c=caches[fp8]: _logits_verdict(
                res, qq, ww, c, md.seq_lens, md.block_table, max_len=max_len
            ),
        )
    scores = logits[True]  # the production path: fp8 indexer cache

    # ---- top-k, remap, fused epilogue ----
    ws = topk_workspace(T, dev)
    pos_buf = torch.empty(T, k, **i32)
    lengths = md.seq_lens
    ref_pos = select_topk_reference(scores, lengths, k)
    positions = stage(
        f"top-k k={k} (fp8 logits)",
        _shape(pos_buf),
        lambda: select_topk(scores, lengths, k=k, out=pos_buf, workspace=ws),
        lambda res: _exact(torch.equal(res, ref_pos)),
    )
    slot_buf = torch.empty(T, k, **i32)
    cnt_buf = torch.empty(T, **i32)
    ref_slots, ref_counts = convert_req_index_to_global_index_reference(
        md.req_id, bt, positions, block_size=page, return_valid_counts=True
    )
    slots, counts = stage(
        "remap -> global slots",
        _shape(slot_buf),
        lambda: convert_req_index_to_global_index(
            md.req_id,
            bt,
            positions,
            block_size=page,
            return_valid_counts=True,
            out=slot_buf,
            valid_counts_out=cnt_buf,
        ),
        lambda res: _exact(torch.equal(res[0], ref_slots) and torch.equal(res[1], ref_counts)),
    )
    fused_buf = torch.empty(T, k, **i32)
    fused_cnt = torch.empty(T, **i32)
    stage(
        "top-k + fused slot epilogue",
        _shape(fused_buf),
        lambda: select_topk(
            scores,
            lengths,
            k=k,
            out=fused_buf,
            block_table=bt,
            req_id=md.req_id,
            block_size=page,
            valid_counts_out=fused_cnt,
            return_valid_counts=True,
            workspace=ws,
        ),
        lambda res: _exact(
            torch.equal(res[0], slots) and torch.equal(res[1], counts),
            "bit-exact vs top-k + remap",
        ),
    )

    # ---- DCP: 2 ranks, each with its own block table over its local positions ----
    inter = size.dcp_interleave
    rank_tables = []
    for rank in range(2):
        local = [dcp_local_len(int(v), 2, rank, inter) for v in lens_h.tolist()]
        rbt, rpages, used = _page_table(local, W, page, g)
        rank_tables.append((rbt.to(dev), rpages, used))
    dcp_out = []
    for rank in range(2):
        rbt = rank_tables[rank][0]
        buf = torch.empty(T, k, **i32)
        cbuf = torch.empty(T, **i32)
        want = convert_req_index_to_global_index_reference(
            md.req_id,
            rbt,
            positions,
            block_size=page,
            dcp_size=2,
            dcp_rank=rank,
            interleave=inter,
            compact=True,
            return_valid_counts=True,
        )
        dcp_out.append(
            stage(
                f"DCP filter + compact, rank {rank}/2",
                _shape(buf),
                lambda rbt=rbt, rank=rank, buf=buf, cbuf=cbuf: filter_and_convert_dcp_index(
                    md.req_id,
                    rbt,
                    positions,
                    dcp_size=2,
                    dcp_rank=rank,
                    interleave=inter,
                    block_size=page,
                    return_valid_counts=True,
                    out=buf,
                    valid_counts_out=cbuf,
                ),
                lambda res, want=want: _exact(
                    torch.equal(res[0], want[0]) and torch.equal(res[1], want[1])
                ),
            )
        )

    def union_check(_):
        ok, why = _dcp_union_matches(positions, md.req_id, dcp_out, rank_tables, page, inter)
        return ok, why

    stage(
        "DCP: union of ranks = selection",
        f"2 x [{T},{k}]",
        lambda: None,
        union_check,
        timed=False,
    )

    # ---- the native form: the same requests, every one with n = uniform_n ----
    n_u = size.uniform_n
    uni = [n_u] * B
    q_u = torch.randn(B * n_u, heads, dim, generator=gd, device=dev).bfloat16()
    w_u = torch.randn(B * n_u, heads, generator=gd, device=dev) * (heads * dim) ** -0.5
    q8_u, w8_u = _quantize_q(q_u, w_u)
    want_native = native_decode_seq_lens_reference(lens_h, next_n=n_u)
    mdn = stage(
        f"metadata: uniform n={n_u} -> native",
        f"[{B},{n_u}]",
        lambda: builder.build(seq_lens, bt, uni),
        lambda m: _exact(
            not m.flattened and torch.equal(m.seq_lens.cpu(), want_native),
            "native; bit-exact vs reference",
        ),
    )
    native_lens = mdn.seq_lens.clone()
    nbuf = torch.empty(B * n_u, max_len, device=dev)
    native = stage(
        f"logits fp8, native n={n_u} (1 key read)",
        _shape(nbuf),
        lambda: index_logits(q8_u, w8_u, caches[True], native_lens, bt, out=nbuf),
        lambda res: _logits_verdict(res, q8_u, w8_u, caches[True], native_lens, bt),
    )
    flat_u = expand_decode_tokens(seq_lens, bt, n_u, max_decode_len=size.max_decode_len)
    fbuf = torch.empty(B * n_u, max_len, device=dev)

    def check_native_vs_flat(res):
        ok, why = _logits_verdict(
            res, q8_u, w8_u, caches[True], flat_u.seq_lens, flat_u.block_table
        )
        same = torch.equal(res, native)
        return ok, why + ("; = native bitwise" if same else "; ~ native (rounding)")

    stage(
        f"logits fp8, flattened ({n_u} key reads)",
        _shape(fbuf),
        lambda: index_logits(
            q8_u, w8_u, caches[True], flat_u.seq_lens, flat_u.block_table, out=fbuf
        ),
        check_native_vs_flat,
    )
    row_req = torch.arange(B, **i32).repeat_interleave(n_u)
    nlen = native_lens.flatten()
    want_pos = select_topk_reference(native, nlen, k)
    want_slots, want_counts = positions_to_slots_reference(want_pos, bt, row_req, block_size=page)
    ubuf = torch.empty(B * n_u, k, **i32)
    ucnt = torch.empty(B * n_u, **i32)
    stage(
        "top-k + fused slots, native rows",
        _shape(ubuf),
        lambda: select_topk(
            native,
            nlen,
            k=k,
            out=ubuf,
            block_table=bt,
            req_id=row_req,
            block_size=page,
            valid_counts_out=ucnt,
            return_valid_counts=True,
            workspace=topk_workspace(B * n_u, dev),
        ),
        lambda res: _exact(torch.equal(res[0], want_slots) and torch.equal(res[1], want_counts)),
    )


def _dcp_union_matches(
    positions: torch.Tensor,
    req_id: torch.Tensor,
    dcp_out: list,
    rank_tables: list,
    page: int,
    inter: int,
) -> tuple[bool, str]:
    """Map every rank's compacted slots back to global positions through that rank's block
    table; per row their union must be exactly the selected positions, each owned once."""
    world = len(dcp_out)
    T, k = positions.shape
    back = []
    for rank, ((slots, counts), (rbt, rpages, used)) in enumerate(
        zip(dcp_out, rank_tables, strict=True)
    ):
        slots, counts, rbt = slots.cpu().long(), counts.cpu().long(), rbt.cpu().long()
        col = torch.arange(k)[None, :]
        if not torch.equal(slots >= 0, col < counts[:, None]):
            return False, f"rank {rank}: output is not a compact prefix of valid_count slots"
        # Inverse of the rank's table: physical page -> (request, logical page).
        page_req = torch.full((rpages,), -1, dtype=torch.long)
        page_idx = torch.full((rpages,), -1, dtype=torch.long)
        for b, m in enumerate(used):
            page_req[rbt[b, :m]] = b
            page_idx[rbt[b, :m]] = torch.arange(m)
        valid = slots >= 0
        phys = torch.where(valid, slots, 0) // page
        local = page_idx[phys] * page + torch.where(valid, slots, 0) % page
        glob = (local // inter) * (world * inter) + rank * inter + local % inter
        req_ok = page_req[phys] == req_id.cpu().long()[:, None]
        if not bool(req_ok[valid].all()):
            return False, f"rank {rank}: a slot lies on another request's page"
        back.append(torch.where(valid, glob, -1))
    union = torch.cat(back, dim=1)
    big = torch.iinfo(torch.long).max
    union = torch.where(union >= 0, union, big).sort(dim=1).values
    want = positions.cpu().long()
    want = torch.where(want >= 0, want, big).sort(dim=1).values
    want = torch.cat([want, torch.full((T, union.shape[1] - k), big)], dim=1)
    ok = torch.equal(union, want)
    total = sum(int(c.sum()) for _, c in dcp_out)
    return ok, (
        f"exact ({total} slots over 2 ranks)"
        if ok
        else "MISMATCH: the ranks' slots do not map back to the global top-k"
    )


def print_stages(stages: list[Stage], log=print) -> None:
    """The stage table."""
    w = max(len(s.name) for s in stages)
    ws = max(max(len(s.shape) for s in stages), 5)
    log(f"  {'stage':{w}}  {'shape':{ws}}  {'time':>14}  verdict")
    for s in stages:
        mark = "PASS" if s.ok else "FAIL"
        log(f"  {s.name:{w}}  {s.shape:{ws}}  {s.time:>14}  {mark} {s.verdict}")


def _default_jobs() -> int:
    from .verify import _cpu_count

    return max(1, min(8, _cpu_count()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="sparse-mla demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--skip-verify", action="store_true", help="skip the quick verify sweep")
    ap.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="batch shapes (default: small on the CPU interpreter, v32 on a GPU)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the batch and of the sweep")
    ap.add_argument(
        "--jobs", type=int, default=None, help="verify worker processes (default: cores, <= 8)"
    )
    args = ap.parse_args(argv)
    dev = default_device()
    size = SIZES[args.size or ("v32" if dev.type == "cuda" else "small")]
    print(" ".join(f"{k}={v}" for k, v in info().items()))
    summary: list[tuple[str, bool]] = []

    print("\n== worked examples ==")
    summary.append(("worked examples", worked_examples()))

    print(f"\n== one DSA decode step, indexer side (--size {size.name}, --seed {args.seed}) ==")
    t0 = time.perf_counter()
    stages = decode_step(size, args.seed)
    print_stages(stages)
    if dev.type == "cuda":
        print(f"  time: median of {size.timing_reps} CUDA-event-timed calls, back to back")
    else:
        print("  time: one call's wall time in Triton's CPU interpreter (not GPU speed)")
    ok = bool(stages) and all(s.ok for s in stages)
    bad = sum(not s.ok for s in stages)
    print(
        f"  {len(stages) - bad}/{len(stages)} stages pass "
        f"({time.perf_counter() - t0:.1f}s incl. reference checks)"
    )
    summary.append(("decode step", ok))

    if not args.skip_verify:
        from .verify import main as verify_main

        jobs = args.jobs or _default_jobs()
        print(f"\n== quick verification sweep (--jobs {jobs}) ==")
        rc = verify_main(["--quick", "--seed", str(args.seed), "--jobs", str(jobs)])
        summary.append(("verify --quick", rc == 0))

    print()
    for name, good in summary:
        print(f"  {name:16} {'PASS' if good else 'FAIL'}")
    passed = all(good for _, good in summary)
    print("demo:", "PASS" if passed else "FAIL")
    return 0 if passed else 1
