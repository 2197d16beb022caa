"""Tuning of :func:`select_topk` (:class:`TopKConfig`) and the launch plan chosen from the
shapes (:func:`plan_topk`): pure, host-only, tested alone.

The defaults are the values measured best on an H200 (``benchmarks/tune_topk.py``; the
reasons are in this package's README). A config is a value: pass one as
``select_topk(..., config=...)`` to change a knob for that call only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..._runtime import cdiv, next_pow2
from .workspace import MAX_SPLITS, PF_CAP, PF_MAX_N

# Largest k: the short-row epilogue unrolls k / 1024 column blocks at compile time.
MAX_K = 16384


@dataclass(frozen=True)
class TopKConfig:
    """Knobs of the top-k kernels (defaults: the measured best; any value stays exact).

    Attributes:
        row_block: chunk of the one-program-per-row kernel; a row of at most this many
            scores is loaded once and kept in registers (power of two >= 256).
        row_warps: warps of the row kernel.
        split_block: chunk of the split kernels; slices are whole chunks (power of two >= 256).
        split_warps: warps of the split kernels.
        split_min_n: rows shorter than this always use the row kernel.
        ctas_per_sm: split heuristic: programs per SM to aim at (hides load latency).
        prefilter_min_scores: ``prefilter=None`` runs the prefilter from this many scores per
            call (rows x N), where it measured faster in CUDA graphs.
        prefilter_mark_min_scores: from this many scores per call the prefilter marks its
            candidates in a bitmap (no atomic round trip per chunk) instead of copying them
            to a buffer (listing them from the bitmap costs the finish 3-4 us, which pays
            from about 2M scores).
        prefilter_sample: most scores the prefilter samples per row (groups of 8 adjacent
            positions; power of two).
        prefilter_min_sample: fewest scores it samples per row (power of two).
        prefilter_sample_spacing: it samples one score in this many of the row's width, so
            about as many sampled scores reach the threshold whatever the width.
        prefilter_warps: warps of its one-program-per-row launches (the sample and the
            finish) when the pass runs several programs per row.
        prefilter_row_warps: the same when the pass runs one program per row (usually
            rows that fill the chip: throughput, not one row's latency, decides).
        fallback_slice: scores per program of the radix launches over the rows the
            prefilter leaves.
        fallback_side_stream: on a GPU, run those radix launches on a side stream beside the
            prefilter's finish (forked from and joined back to the current stream).
        tile_radix_bits: digit width of the radix passes over keys in registers (row kernel
            with the row in registers, prefilter): 5, 6 or 8 (``tl.histogram`` costs more
            per bit with more bins). The split passes keep 8 bits (one launch per pass).
        row_stage_max, split_stage_max: fused slots: stage the block-table entries a
            program's outputs can use (read early, gathered on chip) when there are at most
            this many (row kernel / split write pass); 0 reads them one by one.
        pdl: programmatic dependent launch mode of every launch where it is enabled
            (``_runtime.pdl_prologue``): 3 wait for the launch before, then let the next one
            start; 2 only wait; 0 off. With 3 (or ``pdl_early_prefilter``) a kernel you
            launch next with the PDL attribute must wait before it reads the output.
        pdl_early_prefilter: calls that run the prefilter use mode 1 (let the next launch
            start its programs before waiting), measured faster at every prefilter shape.
        eager_row_max_n: outside CUDA-graph capture on a GPU (``num_splits`` left None),
            rows of at most this many scores take the row kernel: one launch, where the
            split path's six cost the host more than the row kernel's extra GPU time
            (docs/PERF.md); 0 plans eager calls as captured ones.
        eager_prefilter: outside capture (``prefilter`` left None), run the prefilter as
            in a graph; False (default) skips it there: its extra launches and side-stream
            fork cost the host more than it saves the GPU.
        eager_max_scores: the two rules above apply to calls of at most this many scores
            (rows x N); larger ones plan as captured calls, where the GPU time the prefilter
            saves outweighs its launches' host cost (measured from 2^25 scores).
    """

    row_block: int = 4096
    row_warps: int = 8
    split_block: int = 1024
    split_warps: int = 4
    split_min_n: int = 4097
    ctas_per_sm: int = 8
    prefilter_min_scores: int = 1 << 19
    prefilter_mark_min_scores: int = 1 << 21
    prefilter_sample: int = 4096
    prefilter_min_sample: int = 2048
    prefilter_sample_spacing: int = 16
    prefilter_warps: int = 16
    prefilter_row_warps: int = 8
    fallback_slice: int = 4096
    fallback_side_stream: bool = True
    tile_radix_bits: int = 5
    row_stage_max: int = 4096
    split_stage_max: int = 2048
    pdl: int = 3
    pdl_early_prefilter: bool = True
    eager_row_max_n: int = 32768
    eager_prefilter: bool = False
    eager_max_scores: int = 1 << 24


DEFAULT_CONFIG = TopKConfig()


def validate_config(config: TopKConfig) -> None:
    """Reject a config the kernels cannot run (TypeError/ValueError naming the field)."""
    if not isinstance(config, TopKConfig):
        raise TypeError(f"config must be a TopKConfig, got {type(config).__name__}")
    # With its fields' types: 5.0 == 5 and True == 1, so a config equal to a checked one may
    # still hold a float or a bool.
    _validate(config, tuple(type(v) for v in config.__dict__.values()))


@lru_cache(maxsize=64)  # called on every launch: a config is checked once
def _validate(config: TopKConfig, _types: tuple) -> None:
    def pow2(v: int) -> bool:
        return v >= 1 and v & (v - 1) == 0

    for name in ("row_block", "split_block", "prefilter_sample", "prefilter_min_sample"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or not pow2(v) or v < 256:
            raise ValueError(f"config.{name} must be a power of two >= 256, got {v!r}")
    for name in ("row_warps", "split_warps", "prefilter_warps", "prefilter_row_warps"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or not pow2(v) or v > 32:
            raise ValueError(f"config.{name} must be a power of two <= 32, got {v!r}")
    for name in (
        "split_min_n",
        "ctas_per_sm",
        "prefilter_min_scores",
        "prefilter_mark_min_scores",
        "prefilter_sample_spacing",
        "fallback_slice",
        "row_stage_max",
        "split_stage_max",
        "eager_row_max_n",
        "eager_max_scores",
    ):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"config.{name} must be an int >= 0, got {v!r}")
    bits = config.tile_radix_bits
    if type(bits) is not int or bits not in (5, 6, 8):  # (5.0 and True compare equal to ints)
        raise ValueError(f"config.tile_radix_bits must be 5, 6 or 8, got {bits!r}")
    for name in ("fallback_side_stream", "pdl_early_prefilter", "eager_prefilter"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"config.{name} must be a bool, got {getattr(config, name)!r}")
    if type(config.pdl) is not int or config.pdl not in (0, 1, 2, 3):
        raise ValueError(f"config.pdl must be 0, 1, 2 or 3, got {config.pdl!r}")


@dataclass(frozen=True)
class TopKPlan:
    """Launches of one :func:`select_topk` call (from :func:`plan_topk`).

    Attributes:
        path: ``"row"`` (one program per row), ``"split"`` (six radix launches over
            ``rows x splits`` programs) or ``"prefilter"`` (three prefilter launches, then
            the six radix launches over the rows it lists; ``splits`` may be 1 there).
        block_k: column block of the short-row epilogue.
        pdl: programmatic dependent launch mode (0 off; applied where the device has it).
        row_block, one_chunk, row_stage: row kernel: its chunk, whether the row fits one
            chunk (kept in registers), block-table entries staged (fused slots; 0: none).
        splits, slice_len: programs per row of the split and prefilter passes, and the
            scores each owns.
        radix_rows, radix_splits, radix_slice: grid and slice of the radix launches (over
            the prefilter's list: ``radix_rows`` programs loop over the listed rows).
        write_stage: block-table entries the split write pass stages.
        marked, tile, log_words, sample, target, sample_passes: prefilter: candidates
            marked in a bitmap (else copied), most candidates finished on chip, log2 of the
            bitmap's words, sampled scores per row, the sample's target rank, and its radix
            passes (16 bits or more).
        side_stream: fork the radix launches onto a side stream (GPU only).
        warps: warps of the prefilter's sample and finish.
    """

    path: str
    block_k: int
    pdl: int
    row_block: int = 0
    one_chunk: bool = False
    row_stage: int = 0
    splits: int = 1
    slice_len: int = 0
    radix_rows: int = 0
    radix_splits: int = 0
    radix_slice: int = 0
    write_stage: int = 0
    marked: bool = False
    tile: int = 0
    log_words: int = 0
    sample: int = 0
    target: int = 0
    sample_passes: int = 0
    side_stream: bool = False
    warps: int = 0


def choose_num_splits(rows: int, n: int, k: int, num_sms: int, config: TopKConfig) -> int:
    """Programs per row for ``rows`` rows of ``n`` scores, from the shapes only (1: the row
    kernel, or the prefilter's pass with a program per row; see :func:`plan_topk`)."""
    if n <= k or n < config.split_min_n:
        return 1
    want = cdiv(config.ctas_per_sm * num_sms, max(rows, 1))
    return max(1, min(want, cdiv(n, config.split_block), MAX_SPLITS))


def prefilter_applies(n: int, k: int) -> bool:
    """Whether the split path can run the prefilter for rows of ``n`` scores and this k."""
    return 2 * k <= PF_CAP and n <= PF_MAX_N


def prefilter_marks(rows: int, n: int, config: TopKConfig) -> bool:
    """Whether the prefilter of a ``[rows, n]`` call marks its candidates in a bitmap (else
    it copies them out to a buffer)."""
    return rows * n >= config.prefilter_mark_min_scores


def prefilter_sample(n: int, config: TopKConfig) -> int:
    """Scores the prefilter samples from each row of a ``[rows, n]`` call."""
    want = max(next_pow2(cdiv(n, config.prefilter_sample_spacing)), config.prefilter_min_sample)
    return min(want, config.prefilter_sample)


def prefilter_tile(k: int) -> int:
    """Most candidates a row may keep and still finish on chip (a power of two >= 2k; at
    least 256, so tiny k keep tiles of the sizes measured)."""
    return min(PF_CAP, max(next_pow2(4 * k), 256))


def tile_passes_for(bits: int, radix_bits: int) -> int:
    """Passes of the in-register radix select (``radix_bits`` wide digits) that fix at least
    ``bits`` top bits."""
    w0 = 32 - radix_bits * (32 // radix_bits - 1)
    return 1 + cdiv(max(bits - w0, 0), radix_bits)


def stage_size(fused: bool, span: int, block_size: int, most: int, config: TopKConfig) -> int:
    """Block-table entries to stage for outputs among ``span`` consecutive positions (0: read
    them one by one)."""
    pages = next_pow2(cdiv(span, block_size))
    return pages if fused and pages <= most else 0


# Pure and called on every launch: cached to keep host overhead down.
@lru_cache(maxsize=512)
def plan_topk(
    rows: int,
    n: int,
    k: int,
    *,
    num_sms: int,
    fused: bool = False,
    block_size: int = 1,
    num_splits: int | None = None,
    prefilter: bool | None = None,
    config: TopKConfig = DEFAULT_CONFIG,
    eager: bool = False,
) -> TopKPlan:
    """The launches of a ``[rows, n]`` top-k call, from the shapes only (CUDA-graph safe).

    Args:
        rows, n, k: the call's rows, scores per row and positions kept.
        num_sms: multiprocessors of the device (the split heuristic aims at
            ``config.ctas_per_sm`` programs per SM).
        fused: slots are written (the block-table staging depends on it).
        block_size: positions per page (fused slots).
        num_splits: programs per row; None picks from the shapes, 1 the row kernel (with
            ``prefilter=True`` and rows of at least ``2 * config.row_block`` scores: the
            prefilter with one program per row).
        prefilter: None from ``config.prefilter_min_scores`` scores per call, True wherever
            it applies (k <= 2048, n <= 262144), False never. When the shapes leave one
            program per row (rows that fill the chip), it runs for rows of at least
            ``2 * config.row_block`` scores.
        config: the knobs.
        eager: a GPU call outside CUDA-graph capture (``config.eager_row_max_n`` and
            ``config.eager_prefilter`` then apply to the choices left None, in calls of at
            most ``config.eager_max_scores`` scores).
    """
    c = config
    host_bound = eager and rows * n <= c.eager_max_scores
    # num_splits=1 means the row kernel, unless the prefilter is asked for.
    row_only = num_splits == 1 and prefilter is not True
    if host_bound and num_splits is None and n <= c.eager_row_max_n:
        row_only = True
    if host_bound and prefilter is None and not c.eager_prefilter:
        prefilter = False
    if prefilter is None:
        prefilter = rows * n >= c.prefilter_min_scores
    use_prefilter = prefilter and prefilter_applies(n, k)
    block_k = min(max(next_pow2(k), 16), 1024)
    splits = choose_num_splits(rows, n, k, num_sms, c) if num_splits is None else num_splits
    slice_len = cdiv(cdiv(max(n, 1), c.split_block), splits) * c.split_block
    splits = cdiv(max(n, 1), slice_len)  # no empty trailing slices
    # Rows that fill the chip with a program each (the chooser's 1 for rows of at least
    # split_min_n scores), or one program per row asked for with the prefilter: the prefilter
    # reads each row about once, where the row kernel reads a row of more than row_block
    # scores once per radix pass (measured faster from two row blocks on).
    fills_chip = num_splits is None and n >= c.split_min_n
    one_pass = use_prefilter and n >= 2 * c.row_block and (fills_chip or num_splits == 1)
    if row_only or n <= k or (splits <= 1 and not one_pass):
        one_chunk = n <= c.row_block
        return TopKPlan(
            "row",
            block_k,
            c.pdl,
            row_block=min(next_pow2(max(n, 256)), c.row_block) if one_chunk else c.row_block,
            one_chunk=one_chunk,
            row_stage=stage_size(fused, n, block_size, c.row_stage_max, c) if one_chunk else 0,
        )
    if not use_prefilter:
        return TopKPlan(
            "split",
            block_k,
            c.pdl,
            splits=splits,
            slice_len=slice_len,
            radix_rows=rows,
            radix_splits=splits,
            radix_slice=slice_len,
            write_stage=stage_size(fused, slice_len + block_size, block_size, c.split_stage_max, c),
        )
    # Few rows fall back (flat or tie-heavy rows, an unlucky sample), so the radix launches
    # spread each over many programs (slices of fallback_slice scores) and loop over the
    # list; as many programs as the plain grid, so rows that all fall back cost what the
    # plain radix path costs.
    fb_splits = min(cdiv(n, c.fallback_slice), MAX_SPLITS)
    fb_slice = cdiv(cdiv(n, c.split_block), fb_splits) * c.split_block
    fb_splits = cdiv(n, fb_slice)
    tile = prefilter_tile(k)
    return TopKPlan(
        "prefilter",
        block_k,
        1 if c.pdl and c.pdl_early_prefilter else c.pdl,
        splits=splits,
        slice_len=slice_len,
        radix_rows=max(1, min(rows, rows * splits // fb_splits)),
        radix_splits=fb_splits,
        radix_slice=fb_slice,
        write_stage=stage_size(fused, fb_slice + block_size, block_size, c.split_stage_max, c),
        marked=prefilter_marks(rows, n, c),
        tile=tile,
        log_words=(next_pow2(cdiv(n, 32))).bit_length() - 1,
        sample=prefilter_sample(n, c),
        target=math.isqrt(k * tile),
        sample_passes=tile_passes_for(16, c.tile_radix_bits),
        side_stream=c.fallback_side_stream,
        warps=c.prefilter_warps if splits > 1 else c.prefilter_row_warps,
    )
