"""DeepSeek-V4 compressor problems and their check, shared by the tests, ``sparse-mla verify``
and the GPU tests: a layer's persistent tensors (rings, a poisoned compressed cache, its block
table, the weights), one decode step's inputs (ragged MTP rows, padding, rejected drafts), and
that step through ``compressor_decode`` against its reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._runtime import cdiv
from ..ops.compressor import (
    CompressorState,
    compressor_rope_table,
    new_compressor_state,
)
from ..ops.compressor.naive import compressor_step_reference, write_entries_reference
from ..ops.kv_cache import (
    dequantize_indexer_k_cache,
    dequantize_model1_cache,
    new_indexer_k_cache,
    new_mla_cache,
)
from .checks import compressor_entry_error

CACHE_KINDS = ("bf16", "fp8", "model1_fp8")
POISON_BYTE = 0xA5  # unwritten cache bytes keep it (bf16 0xA5A5: a finite -2.9e-16)


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor layer's shapes. ``cache``: "bf16" (indexer bf16 / MODEL1 bf16 rows),
    "fp8" (the indexer's fp8 format), "model1_fp8" (``dim`` 512). ``hostile``: a padding
    request (state -1), one past the states, -1 and out-of-range pages, a RoPE table shorter
    than the positions."""

    compress_rate: int
    overlap: bool
    dim: int
    rope: int
    cache: str = "bf16"
    requests: int = 3
    max_decode_len: int = 4
    page: int = 4
    max_entries: int = 12
    dtype: torch.dtype = torch.bfloat16
    gate_dtype: torch.dtype = torch.bfloat16
    hostile: bool = False

    @property
    def width(self) -> int:
        return self.dim * (2 if self.overlap else 1)


# DeepSeek-V4's compressors (V4-Flash): CSA's attention compressor, HCA's, the indexer's.
V4_SPECS = {
    "csa": CompressorSpec(4, True, 512, 64, "model1_fp8"),
    "hca": CompressorSpec(128, False, 512, 64, "model1_fp8"),
    "indexer": CompressorSpec(4, True, 128, 64, "fp8"),
}


@dataclass
class CompressorProblem:
    """A layer's persistent tensors, and ``lengths``: each request's accepted length (the
    next step's rows start there)."""

    spec: CompressorSpec
    state: CompressorState
    cache: torch.Tensor
    cache_base: torch.Tensor  # uint8, every byte of ``cache``'s storage (compared)
    block_table: torch.Tensor
    state_index: torch.Tensor | None
    position_bias: torch.Tensor
    norm_weight: torch.Tensor
    cos_sin: torch.Tensor
    eps: float
    lengths: list[int] = field(default_factory=list)


def _new_cache(spec: CompressorSpec, pages: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.cache == "model1_fp8":
        cache = new_mla_cache(pages, spec.page, format="model1_fp8", device=device)
    else:
        cache = new_indexer_k_cache(pages, spec.page, head_dim=spec.dim,
                                    fp8=spec.cache == "fp8", device=device)  # fmt: skip
    base = storage_bytes(cache)
    base.fill_(POISON_BYTE)
    return cache, base


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 ``[bytes]``: the whole storage under ``t`` (its padding between pages too)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def same_layout(t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``t``'s view (shape, strides, offset) over another storage's bytes ``base``."""
    return base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def compressor_problem(
    g: torch.Generator,
    spec: CompressorSpec,
    device: torch.device | str,
    *,
    start_lengths: list[int] | None = None,
) -> CompressorProblem:
    """Random weights (gates and biases wide enough that the softmax is not flat), NaN rings
    (a read of a never-written row shows), a poisoned cache with distinct random pages per
    request; each request starts at ``start_lengths`` (default random, some at 0)."""
    b, d, w = spec.requests, spec.dim, spec.width
    states = b + 2
    state = new_compressor_state(
        states, w, compress_rate=spec.compress_rate, overlap=spec.overlap,
        max_decode_len=spec.max_decode_len, dtype=spec.dtype, gate_dtype=spec.gate_dtype,
        device=device,
    )  # fmt: skip
    state.kv.fill_(float("nan"))
    state.gate.fill_(float("nan"))
    cols = cdiv(spec.max_entries, spec.page)
    pages = b * cols + 3
    cache, base = _new_cache(spec, pages, device)
    table = torch.randperm(pages, generator=g)[: b * cols].view(b, cols).int()
    order = torch.randperm(states, generator=g)[:b].int()
    if spec.hostile:
        table[0, -1] = -1
        table[-1, 0] = pages + 5
        order[0] = -1 if b > 1 else order[0]
        order[-1] = states + 1 if b > 2 else order[-1]
    half = spec.rope // 2
    inv_freq = 1.0 / (float(rand_float(g, 100.0, 2e5)) ** (torch.arange(half) / max(half, 1)))
    positions = spec.max_entries * spec.compress_rate
    table_rows = positions // 3 if spec.hostile else positions + spec.max_decode_len
    if start_lengths is None:
        top = max(positions - 3 * spec.max_decode_len, 0)
        start_lengths = [0 if i % 3 == 0 else int(torch.randint(0, top + 1, (), generator=g))
                         for i in range(b)]  # fmt: skip
    _prefill_rings(g, state, order, start_lengths)
    return CompressorProblem(
        spec=spec,
        state=state,
        cache=cache,
        cache_base=base,
        block_table=table.to(device),
        state_index=order.to(device),
        position_bias=(torch.randn(spec.compress_rate, w, generator=g) * 0.7).to(device),
        norm_weight=(1 + 0.3 * torch.randn(d, generator=g)).to(device),
        cos_sin=compressor_rope_table(inv_freq, max(table_rows, 1)).to(device),
        eps=1e-6,
        lengths=list(start_lengths),
    )


def _prefill_rings(g, state: CompressorState, order, lengths: list[int]) -> None:
    """What a prefill leaves: the rows of the positions before each request's length that
    its ring still holds (random); the rest of the rings stay NaN."""
    states, ring, _ = state.kv.shape
    for s, length in zip(order.tolist(), lengths, strict=True):
        if 0 <= s < states:
            for pos in range(max(length - ring, 0), length):
                state.kv[s, pos % ring] = torch.randn(state.kv.shape[2], generator=g)
                state.gate[s, pos % ring] = torch.randn(state.kv.shape[2], generator=g) * 2


def rand_float(g: torch.Generator, lo: float, hi: float) -> float:
    """Log-uniform float in [lo, hi]."""
    return lo * (hi / lo) ** float(torch.rand((), generator=g))


@dataclass
class CompressorStep:
    """One step's inputs (``compressor_decode``'s per-step arguments)."""

    kv: torch.Tensor
    gate: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    decode_len: int | None
    decode_lens: list[int]


def compressor_step_inputs(
    g: torch.Generator,
    problem: CompressorProblem,
    decode_lens: list[int],
    *,
    uniform: bool = False,
    extra_rows: int = 0,
    strided: bool = False,
) -> CompressorStep:
    """Rows for ``decode_lens[b]`` tokens of each request from its accepted length (then
    ``extra_rows`` padding rows, never read); ``uniform``: every request has
    ``decode_lens[0]`` rows, given as ``decode_len``; ``strided``: kv and gate are column
    slices of wider tensors and seq_lens a strided view. kv rows at mixed magnitudes."""
    spec, dev = problem.spec, problem.cache.device
    if uniform:
        decode_lens = [decode_lens[0]] * spec.requests
    rows = sum(decode_lens) + extra_rows
    pad = 3 if strided else 0
    mag = torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    kv = (torch.randn(rows, spec.width + pad, generator=g) * mag).to(spec.dtype)
    gate = (torch.randn(rows, spec.width + pad, generator=g) * 2).to(spec.gate_dtype)
    kv, gate = kv[:, pad:].to(dev), gate[:, : spec.width].to(dev)
    lens = torch.tensor([n + l for n, l in zip(decode_lens, problem.lengths, strict=True)],
                        dtype=torch.int32)  # fmt: skip
    if strided:
        lens = torch.stack([lens, -lens], 1)[:, 0]
    qsl = None
    if not uniform:
        offsets = [0]
        for n in decode_lens:
            offsets.append(offsets[-1] + n)
        qsl = torch.tensor(offsets, dtype=torch.int32, device=dev)
    return CompressorStep(kv, gate, lens.to(dev), qsl, decode_lens[0] if uniform else None,
                          list(decode_lens))  # fmt: skip


def run_compressor_step(problem: CompressorProblem, step: CompressorStep, *, fn=None) -> None:
    """``compressor_decode`` (or ``fn``, the same signature) on the problem's tensors."""
    from ..ops.compressor import compressor_decode

    spec = problem.spec
    (fn or compressor_decode)(
        step.kv, step.gate, problem.state.kv, problem.state.gate, problem.cache, step.seq_lens,
        problem.block_table, problem.position_bias, problem.norm_weight, problem.cos_sin,
        compress_rate=spec.compress_rate, overlap=spec.overlap,
        max_decode_len=spec.max_decode_len, eps=problem.eps,
        query_start_loc=step.query_start_loc, decode_len=step.decode_len,
        state_index=problem.state_index,
    )  # fmt: skip


def check_compressor_step(
    problem: CompressorProblem,
    step: CompressorStep,
    accepted: list[int] | None = None,
    *,
    fn=None,
) -> str | None:
    """Run one step through the kernel and the reference; None when they agree, else what
    differs: the rings bit for bit, every cache byte no entry was written to untouched, each
    written entry (dequantised) within :func:`compressor_entry_error`'s tolerance of the
    float64 reference. Then the requests' lengths advance by ``accepted`` (default every
    row: rejected MTP drafts are rows not accepted)."""
    spec = problem.spec
    ref_state = CompressorState(problem.state.kv.clone(), problem.state.gate.clone())
    before = problem.cache_base.clone()
    run_compressor_step(problem, step, fn=fn)
    c3 = problem.cache[:, :, 0, :] if problem.cache.dim() == 4 else problem.cache
    ref = compressor_step_reference(
        step.kv, step.gate, ref_state.kv, ref_state.gate, step.seq_lens, problem.block_table,
        problem.position_bias, problem.norm_weight, problem.cos_sin,
        compress_rate=spec.compress_rate, overlap=spec.overlap,
        max_decode_len=spec.max_decode_len, block_size=c3.shape[1], num_pages=c3.shape[0],
        eps=problem.eps, query_start_loc=step.query_start_loc, decode_len=step.decode_len,
        state_index=problem.state_index,
    )  # fmt: skip
    accepted = step.decode_lens if accepted is None else accepted
    problem.lengths = [n + a for n, a in zip(problem.lengths, accepted, strict=True)]
    for name, got, want in (("state_kv", problem.state.kv, ref_state.kv),
                            ("state_gate", problem.state.gate, ref_state.gate)):  # fmt: skip
        if not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)):
            return f"{name} differs from the reference's ring"
    written = _written_bytes(problem, ref.entries, ref.slots)
    untouched = ~written
    if not torch.equal(problem.cache_base[untouched], before[untouched]):
        return "bytes outside the written entries changed"
    emitted = ref.slots >= 0
    if not emitted.any():
        return None
    dequant = _dequantize(problem.cache).flatten(0, 1)
    got = dequant[ref.slots[emitted]]
    return compressor_entry_error(got, ref.entries[emitted], fp8=spec.cache != "bf16")


def _written_bytes(problem: CompressorProblem, entries, slots) -> torch.Tensor:
    """bool over ``cache_base``'s bytes: those the reference writer writes for these entries
    (written on a 0x00 and a 0xFF copy: the bytes that come out equal)."""
    out = []
    for fill in (0x00, 0xFF):
        base = torch.full_like(problem.cache_base, fill)
        write_entries_reference(entries, slots, same_layout(problem.cache, base))
        out.append(base)
    return out[0] == out[1]


def _dequantize(cache: torch.Tensor) -> torch.Tensor:
    if cache.dtype == torch.uint8 and cache.shape[-1] == 584:
        return dequantize_model1_cache(cache)
    return dequantize_indexer_k_cache(cache)


def random_decode_lens(g: torch.Generator, spec: CompressorSpec) -> list[int]:
    """Each request's rows this step: 0 to ``max_decode_len``, mostly the maximum."""
    hi = spec.max_decode_len
    draws = [int(torch.randint(0, hi + 1, (), generator=g)) for _ in range(spec.requests)]
    return [hi if float(torch.rand((), generator=g)) < 0.6 else n for n in draws]


def random_accepted(g: torch.Generator, decode_lens: list[int]) -> list[int]:
    """Rows kept of each request's step (MTP: the first always, drafts maybe rejected)."""
    return [n if n == 0 or float(torch.rand((), generator=g)) < 0.5
            else int(torch.randint(1, n + 1, (), generator=g)) for n in decode_lens]  # fmt: skip


def compressor_op_args(dev: torch.device) -> tuple:
    """``compressor_decode``'s op arguments (schema order) for a small CSA step: two
    requests of two rows (the first closing a window), fp8 indexer cache, state indices."""
    spec = CompressorSpec(4, True, 16, 4, "fp8", requests=2, max_decode_len=2)
    g = torch.Generator().manual_seed(3)
    p = compressor_problem(g, spec, dev, start_lengths=[2, 5])
    x = compressor_step_inputs(g, p, [2, 2])
    return (
        x.kv, x.gate, p.state.kv, p.state.gate, p.cache, x.seq_lens, p.block_table,
        p.position_bias, p.norm_weight, p.cos_sin, 4, True, 2, 1e-6, x.query_start_loc, None,
        p.state_index,
    )  # fmt: skip
