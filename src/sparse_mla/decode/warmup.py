"""Compile, before the first request, the kernels a decode configuration launches.

Triton compiles a kernel on its first launch with a new specialisation (constexprs, dtypes,
integers equal to 1 or divisible by 16), and the library's host plans choose kernels from
the shapes (rows, top-k width, heads, whether a CUDA graph is being captured). So the set an
engine will launch is the one :class:`~sparse_mla.decode.DecodePlan` launches for the same
configuration at the same token counts: :func:`warmup` runs that plan on zero-filled inputs
of those shapes (a small page pool behind a full-width block table, so memory stays small),
eagerly and, on a GPU, captured and replayed as one CUDA graph, as an engine's capture does,
with int32 and int64 ``slot_mapping`` alike.

Compiled kernels also land in Triton's on-disk cache (``TRITON_CACHE_DIR``), so a later
process loads them instead of compiling. Steps that pass ``max_seq_len`` narrower than the
block table plan top-k for that width and may compile more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .._checks import check_int
from .._runtime import INTERPRETER, canonical_device, mode
from ..ops.kv_cache import new_indexer_k_cache, new_mla_cache
from .plan import LATENT_DIM, MAX_NATIVE_N, DecodeInputs, DecodePlan, DecodePlanConfig

# Batch sizes engines commonly capture CUDA graphs for (token counts: times decode_len).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CACHE_FORMATS = ("bf16", "fp8")
_SM_SCALE = 192**-0.5  # DeepSeek's qk head dim; any value compiles the same kernels


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` did.

    seconds: wall time of the warm-up (compiles included).
    compiled: Triton kernels compiled (or loaded from Triton's disk cache) during it; None
        under the interpreter or where this Triton cannot count (no ``triton.knobs``).
    again_seconds, again_compiled: the same launches once more, after the warm-up (what a
        first request now costs; ``again_compiled`` should be 0). None under the interpreter,
        which compiles nothing and runs the launches once.
    token_counts: the step sizes run (under the interpreter: one tiny step).
    max_seq_len: the block table's reach in tokens (under the interpreter: two pages).
    mode: "cuda" or "interpreter".
    """

    seconds: float
    compiled: int | None
    again_seconds: float | None
    again_compiled: int | None
    token_counts: tuple[int, ...]
    max_seq_len: int
    mode: str

    def summary(self) -> str:
        """One or two lines for a log."""
        sizes = f"T = {', '.join(map(str, self.token_counts))}, {self.max_seq_len} tokens"
        if self.again_seconds is None:
            return (
                f"warm-up ({self.mode}: nothing to compile; the step's launches ran at "
                f"{sizes}): {self.seconds:.2f} s"
            )
        count = "?" if self.compiled is None else str(self.compiled)
        again = "?" if self.again_compiled is None else str(self.again_compiled)
        return (
            f"warm-up ({self.mode}, {sizes}): {self.seconds:.2f} s, {count} kernels compiled "
            f"or loaded from Triton's cache\nthe same launches again: "
            f"{self.again_seconds:.3f} s, {again} compiled"
        )


def warmup(
    *,
    num_heads: int,
    cache_format: str = "fp8",
    topk: int = 2048,
    block_size: int = 64,
    max_seq_len: int = 131072,
    num_pages: int | None = None,
    token_counts: Sequence[int] | None = None,
    decode_len: int = 1,
    ragged: bool = False,
    remap: str = "topk",
    graphs: bool = True,
    device: torch.device | str | None = None,
) -> WarmupReport:
    """Compile the kernels a decode step of this configuration launches, so an engine pays
    no compile on its first request.

    Args:
        num_heads: ``h_q`` of the absorbed MLA query on this GPU (128 / tensor-parallel size
            for DeepSeek-V3.2), 1 to 128.
        cache_format: "fp8" (FlashMLA's latent cache and DeepGEMM's indexer cache, fp8
            indexer queries) or "bf16" (both caches bf16).
        topk: the indexer's k. block_size: tokens per cache page.
        max_seq_len: the longest request in tokens (the block table's width is
            ``ceil(max_seq_len / block_size)`` pages, as the engine sizes it).
        num_pages: pages per layer of the engine's caches. The indexer kernel is
            specialised on whether that count is 1 or a multiple of 16, so the warm-up's
            small page pool keeps its remainder mod 16; None warms both a multiple of 16
            and not.
        token_counts: the step sizes ``T`` (query rows, CUDA-graph padding included) the
            engine runs, each a multiple of ``decode_len``: e.g. its CUDA-graph capture sizes
            (default: ``decode_len`` times each of :data:`DEFAULT_BATCH_SIZES`).
        decode_len: query tokens per request (1 + speculative tokens), 1 to 8.
        ragged: also run each size with unequal ``n_b`` (the flattened-row kernels; needs
            ``decode_len`` > 1).
        remap: where positions become cache slots, as ``DecodePlanConfig.remap``.
        graphs: on a GPU, also capture and replay each size as one CUDA graph (top-k plans
            captured calls differently from eager ones).
        device: where to run (default: where the library's kernels run).

    Under the interpreter nothing compiles: the step runs once at one tiny size (one request,
    two with ``ragged``), a check that the configuration is accepted.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """
    counts = _check_options(locals())
    dev = canonical_device(device)
    compiled = not INTERPRETER and dev.type == "cuda"
    if not compiled:
        requests = 2 if ragged else 1  # the least that makes unequal lengths
        counts, graphs = (requests * decode_len,), False
        max_seq_len = min(max_seq_len, 2 * block_size)
    n, pages = decode_len, -(-max_seq_len // block_size)
    config = DecodePlanConfig(
        max_num_tokens=max(counts),
        max_num_requests=max(counts) // n,
        max_blocks_per_req=pages,
        num_heads=num_heads,
        topk=topk,
        max_decode_len=n,
        block_size=block_size,
        mla_fp8=cache_format == "fp8",
        remap=remap,
    )
    plan = DecodePlan(config, sm_scale=_SM_SCALE, device=dev)
    pools = [_caches(config, p, dev) for p in _pool_sizes(num_pages)]
    steps = [_step(plan, c, t, n, max_seq_len, ragged, graphs) for c in pools for t in counts]
    seconds, kernels = _timed(steps, dev)
    if not compiled:
        return WarmupReport(seconds, None, None, None, counts, max_seq_len, mode())
    again_seconds, again_kernels = _timed(steps, dev)
    return WarmupReport(seconds, kernels, again_seconds, again_kernels, counts, max_seq_len, mode())


def _check_options(o: dict) -> tuple[int, ...]:
    """The checks :class:`DecodePlan` does not make (``o``: warmup's keyword arguments);
    returns the token counts as a tuple."""
    check_int("num_heads", o["num_heads"], lo=1, hi=128)
    check_int("decode_len", o["decode_len"], lo=1, hi=MAX_NATIVE_N)
    check_int("block_size", o["block_size"], lo=1, hi=2**20)
    check_int("max_seq_len", o["max_seq_len"], lo=1, hi=2**31 - 1)
    if o["num_pages"] is not None:
        check_int("num_pages", o["num_pages"], lo=1, hi=2**31 - 1)
    if o["cache_format"] not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {CACHE_FORMATS}, got {o['cache_format']!r}")
    for name in ("ragged", "graphs"):
        if not isinstance(o[name], bool):
            raise TypeError(f"{name} must be a bool, got {type(o[name]).__name__}")
    n = o["decode_len"]
    if o["token_counts"] is None:
        return tuple(n * b for b in DEFAULT_BATCH_SIZES)
    counts = tuple(o["token_counts"])
    if not counts:
        raise ValueError("token_counts is empty")
    for t in counts:
        check_int("token_counts entry", t, lo=1, hi=2**20)
        if t % n:
            raise ValueError(
                f"token_counts entry {t} is not a multiple of decode_len={n} "
                "(a step's rows are whole requests)"
            )
    return counts


def _pool_sizes(num_pages: int | None) -> tuple[int, ...]:
    """Small page counts that Triton specialises as it would ``num_pages`` (1, a multiple of
    16, or neither; page count times page size keeps its class too): the same remainder mod
    16. None: one multiple of 16 and one not."""
    if num_pages is None:
        return (16, 17)
    return (num_pages,) if num_pages <= 16 else (16 + num_pages % 16,)


def _caches(config: DecodePlanConfig, pages: int, device: torch.device) -> dict:
    """Both caches with ``pages`` pages, and the block-table row that cycles over them to the
    plan's full width."""
    fp8 = config.mla_fp8
    return {
        "index_k_cache": new_indexer_k_cache(pages, config.block_size, fp8=fp8, device=device),
        "kv_cache": new_mla_cache(pages, config.block_size, fp8=fp8, device=device),
        "row": torch.arange(config.max_blocks_per_req, device=device, dtype=torch.int32) % pages,
    }


def _inputs(config: DecodePlanConfig, caches: dict, rows: int, requests: int, max_seq_len: int):
    """Zero-filled step inputs of ``rows`` query rows over ``requests`` requests."""
    dev, c = caches["row"].device, config
    slots = caches["kv_cache"].shape[0] * c.block_size  # rows beyond it share slots: harmless
    idx_dtype = torch.float8_e4m3fn if c.mla_fp8 else torch.bfloat16
    return DecodeInputs(
        q_idx=torch.zeros(rows, c.index_heads, c.index_dim, dtype=idx_dtype, device=dev),
        idx_weights=torch.zeros(rows, c.index_heads, dtype=torch.float32, device=dev),
        k_idx=torch.zeros(rows, c.index_dim, dtype=torch.bfloat16, device=dev),
        q=torch.zeros(rows, c.num_heads, LATENT_DIM, dtype=torch.bfloat16, device=dev),
        kv=torch.zeros(rows, LATENT_DIM, dtype=torch.bfloat16, device=dev),
        slot_mapping=torch.arange(rows, dtype=torch.int32, device=dev) % slots,
        index_k_cache=caches["index_k_cache"],
        kv_cache=caches["kv_cache"],
        seq_lens=torch.full((requests,), max_seq_len, dtype=torch.int32, device=dev),
        block_table=caches["row"].expand(requests, -1).contiguous(),
    )


def _step(
    plan: DecodePlan, caches: dict, rows: int, n: int, max_seq_len: int, ragged: bool, graphs: bool
) -> Callable[[], None]:
    """The launches of one step size: eager, unequal lengths (flattened rows), a graph, and
    int64 slots (vLLM and SGLang hand out int64 ``slot_mapping``: other cache writers)."""
    requests = rows // n
    x = _inputs(plan.config, caches, rows, requests, max_seq_len)
    x64 = x._replace(slot_mapping=x.slot_mapping.long())

    def run() -> None:
        if graphs:  # capture() first runs the step eagerly on its stream (eager plans)
            plan.capture(x, n)
            plan.replay()
        else:
            plan.run(x, [n] * requests)
        if ragged and requests > 1 and n > 1:  # unequal n_b: flattened rows, one padding row
            plan.run(x, [n - 1] + [n] * (requests - 1), num_tokens=rows)
        plan.run(x64, [n] * requests)

    return run


def _timed(steps: list[Callable[[], None]], device: torch.device) -> tuple[float, int | None]:
    """Wall time of running ``steps`` (device synchronised) and the kernels compiled."""
    with _counting_compiles() as counter:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for step in steps:
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, counter()


@contextmanager
def _counting_compiles() -> Iterator[Callable[[], int | None]]:
    """Counts Triton's in-memory cache misses (each a compile or a load from its disk cache)
    through ``triton.knobs.runtime.jit_cache_hook``, chained to any hook already set; yields
    a function returning the count (None where this Triton has no such hook)."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4
        knobs = None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        yield lambda: None
        return
    previous, misses = runtime.jit_cache_hook, [0]

    def hook(*args, **kwargs):
        misses[0] += 1
        return previous(*args, **kwargs) if previous is not None else False

    runtime.jit_cache_hook = hook
    try:
        yield lambda: misses[0]
    finally:
        runtime.jit_cache_hook = previous


def main(argv: Sequence[str] | None = None) -> int:
    """``sparse-mla warmup``: :func:`warmup` from the command line; prints how long it took."""
    import argparse

    p = argparse.ArgumentParser(prog="sparse-mla warmup", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=128, help="h_q per GPU (default 128)")
    p.add_argument("--cache", choices=CACHE_FORMATS, default="fp8", help="cache format")
    p.add_argument("--topk", type=int, default=2048, help="the indexer's k (default 2048)")
    p.add_argument("--page", type=int, default=64, help="tokens per cache page (default 64)")
    p.add_argument("--max-seq-len", type=int, default=131072, help="longest request, tokens")
    p.add_argument("--pages", type=int, default=None, help="cache pages per layer (default: any)")
    p.add_argument(
        "--tokens",
        type=_int_list,
        default=None,
        help="step sizes T, comma-separated (default: decode-len x 1,2,4,...,512)",
    )
    p.add_argument("--decode-len", type=int, default=1, help="tokens per request (1 + MTP)")
    p.add_argument("--ragged", action="store_true", help="also unequal tokens per request")
    p.add_argument("--remap", choices=("topk", "attention", "separate"), default="topk")
    p.add_argument("--no-graphs", action="store_true", help="eager launches only")
    args = p.parse_args(argv)
    try:
        report = warmup(
            num_heads=args.heads,
            cache_format=args.cache,
            topk=args.topk,
            block_size=args.page,
            max_seq_len=args.max_seq_len,
            num_pages=args.pages,
            token_counts=args.tokens,
            decode_len=args.decode_len,
            ragged=args.ragged,
            remap=args.remap,
            graphs=not args.no_graphs,
        )
    except (TypeError, ValueError) as e:
        p.error(str(e))  # exits with status 2
    print(report.summary())
    return 0


def _int_list(text: str) -> list[int]:
    """``--tokens 1,2,4``."""
    return [int(v) for v in text.split(",")]
