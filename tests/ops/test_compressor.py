"""DeepSeek-V4's compressors (``compressor_decode``) in the interpreter: random multi-step
problems against the float64 reference (rings bit for bit, untouched cache bytes, entries
within the kit's tolerance), windows closing where they must (hand formula), MTP drafts
rejected, padding, strided inputs, fp8 bytes from the same pooled rows, bad input.
transformers' own modules: test_compressor_hf.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla._launch import clear_host_plans
from sparse_mla._runtime import default_device
from sparse_mla.ops.compressor import api as compressor_api
from sparse_mla.ops.compressor import (
    compressor_decode,
    compressor_decode_reference,
    compressor_rope_table,
    compressor_state_rows,
    new_compressor_state,
)
from sparse_mla.ops.compressor.naive import window_span, write_entries_reference
from sparse_mla.ops.kv_cache import new_indexer_k_cache
from sparse_mla.testing.compressor import (
    POISON_BYTE,
    V4_SPECS,
    CompressorSpec,
    check_compressor_step,
    compressor_problem,
    compressor_step_inputs,
    random_accepted,
    random_decode_lens,
    run_compressor_step,
    storage_bytes,
)

DEV = default_device()
I32 = torch.int32

SPECS = {
    "csa_bf16": CompressorSpec(4, True, 32, 8, "bf16"),
    "hca_fp8": CompressorSpec(8, False, 32, 8, "fp8", max_decode_len=3),
    "csa_model1_fp8": CompressorSpec(4, True, 512, 64, "model1_fp8", requests=2),
    "hca_fp32_rows": CompressorSpec(16, False, 16, 16, "bf16", dtype=torch.float32,
                                    gate_dtype=torch.float32, max_decode_len=2),
    "hostile": CompressorSpec(2, True, 16, 4, "fp8", requests=4, hostile=True),
}  # fmt: skip


def _steps(spec, seed, steps=4, **kw):
    """A problem and ``steps`` random steps, each checked; the problem returned."""
    g = torch.Generator().manual_seed(seed)
    problem = compressor_problem(g, spec, DEV, **kw)
    for s in range(steps):
        lens = random_decode_lens(g, spec)
        step = compressor_step_inputs(
            g, problem, lens, uniform=s == 2, extra_rows=s % 2, strided=s % 2 == 1
        )
        err = check_compressor_step(problem, step, random_accepted(g, step.decode_lens))
        assert err is None, f"step {s}: {err}"
    return problem


@pytest.mark.parametrize("name", SPECS)
def test_random_steps_match_reference(name, seed):
    _steps(SPECS[name], seed)


def _corrupt_entry(problem):
    rows = problem.cache.view(-1, problem.spec.dim)
    rows[sorted(_written_slots(problem.cache))[0], 3] += 0.25


def _corrupt_untouched(problem):
    rows = problem.cache.view(-1, problem.spec.dim)
    unwritten = set(range(rows.shape[0])) - _written_slots(problem.cache)
    rows[min(unwritten), 0] = 0.0


def _corrupt_ring(problem):
    problem.state.gate[problem.state_index[1], 0, 5] += 1.0


@pytest.mark.parametrize("corrupt", [_corrupt_entry, _corrupt_untouched, _corrupt_ring])
def test_the_check_catches_a_wrong_kernel(corrupt, seed):
    """A planted error after the kernel (an entry off by 0.25 in one element, a write to a
    slot no entry goes to, a ring element) fails the kit's check."""
    g = torch.Generator().manual_seed(seed)
    problem = compressor_problem(g, SPECS["csa_bf16"], DEV, start_lengths=[3, 7, 3])
    step = compressor_step_inputs(g, problem, [4, 4, 4])

    def planted(*args, **kwargs):
        compressor_decode(*args, **kwargs)
        corrupt(problem)

    assert check_compressor_step(problem, step, fn=planted) is not None


# ---- where windows close: a hand formula, not the reference ----------------------------------


def _written_slots(cache: torch.Tensor) -> set[int]:
    """Slots of a bf16 cache whose row is no longer all poison."""
    rows = cache.view(-1, cache.shape[-1]).view(torch.int16)
    poison = torch.tensor(POISON_BYTE * 0x101, dtype=torch.int32).to(torch.int16)
    return set((rows != poison).any(dim=1).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    ("rate", "overlap", "starts", "n"),
    [
        (4, True, [3, 0, 7, 1], 4),  # closes on the first row, the last, at position 0..3
        (4, False, [2, 5, 0, 9], 3),  # n < rate: some requests close nothing
        (2, True, [0, 1, 6, 3], 4),  # two windows close in one step's rows
        (1, True, [0, 4, 2, 5], 4),  # every row closes a window (span 2 with the overlap)
    ],
)
def test_entries_close_where_the_formula_says(rate, overlap, starts, n, seed):
    spec = CompressorSpec(rate, overlap, 16, 4, "bf16", requests=4, max_decode_len=n, page=2,
                          max_entries=16)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    problem = compressor_problem(g, spec, DEV, start_lengths=starts)
    step = compressor_step_inputs(g, problem, [n] * 4)
    assert check_compressor_step(problem, step) is None
    want = set()
    bt = problem.block_table.cpu()
    for b, start in enumerate(starts):
        for pos in range(start, start + n):
            if (pos + 1) % rate == 0:  # entry k = (pos + 1) / rate - 1 at its page's offset
                k = (pos + 1) // rate - 1
                want.add(int(bt[b, k // spec.page]) * spec.page + k % spec.page)
    assert want, "the case closes no window"
    assert _written_slots(problem.cache.cpu()) == want


def test_worked_example_equal_gates_pool_the_mean():
    """Equal gates, zero bias, unit norm weight, no RoPE: the entry is rmsnorm(mean of the
    window's rows); with CSA's overlap the first entry has no previous window (weight 0)."""
    d, rate = 16, 2
    rows = torch.arange(4 * 2 * d, dtype=torch.float32).view(4, 2 * d) / 50 - 1
    caches = []
    for fn in (compressor_decode, compressor_decode_reference):
        state = new_compressor_state(1, 2 * d, compress_rate=rate, overlap=True,
                                     max_decode_len=4, dtype=torch.float32, device=DEV)  # fmt: skip
        cache = new_indexer_k_cache(2, 2, head_dim=d, fp8=False, device=DEV)
        fn(
            rows.to(DEV), torch.zeros_like(rows, device=DEV), state.kv, state.gate, cache,
            torch.tensor([4], dtype=I32, device=DEV),
            torch.tensor([[1, 0]], dtype=I32, device=DEV), torch.zeros(rate, 2 * d, device=DEV),
            torch.ones(d, device=DEV), torch.zeros(1, 0, device=DEV), compress_rate=rate,
            overlap=True, max_decode_len=4, eps=0.0, decode_len=4,
        )  # fmt: skip
        caches.append(cache)

    def rmsnorm(x):
        return x / x.square().mean().sqrt()

    want0 = rmsnorm(rows[0:2, d:].mean(0))  # entry 0: this window's second halves only
    want1 = rmsnorm(torch.cat([rows[0:2, :d], rows[2:4, d:]]).mean(0))
    for cache in caches:  # the kernel's, the reference's
        got = cache.float().cpu()  # page 1 holds entries 0, 1
        torch.testing.assert_close(got[1, 0], want0, rtol=2**-8, atol=0)
        torch.testing.assert_close(got[1, 1], want1, rtol=2**-8, atol=0)
        assert (cache[0] == 0).all()


# ---- MTP drafts rejected, padding, strides ---------------------------------------------------


def _stream_run(spec, stream_kv, stream_gate, schedule, g, seed_garbage):
    """Feed a request's token stream: each step ``(n, accepted)`` sends ``n`` rows from the
    accepted length (the first ``accepted`` from the stream, the rest garbage drafts)."""
    problem = compressor_problem(torch.Generator().manual_seed(7), spec, DEV, start_lengths=[0])
    garbage = torch.Generator().manual_seed(seed_garbage)
    for n, accepted in schedule:
        step = compressor_step_inputs(g, problem, [n])
        at = problem.lengths[0]
        kv, gate = stream_kv[at : at + n].clone(), stream_gate[at : at + n].clone()
        kv[accepted:] = torch.randn(n - accepted, spec.width, generator=garbage).to(kv.dtype)
        gate[accepted:] = torch.randn(n - accepted, spec.width, generator=garbage).to(kv.dtype)
        step.kv.copy_(kv)
        step.gate.copy_(gate)
        run_compressor_step(problem, step)
        problem.lengths[0] += accepted
    return problem


def test_rejected_drafts_leave_what_a_clean_run_leaves(seed):
    """Rows of rejected drafts are overwritten before any later entry reads them: the ring
    sized by compressor_state_rows keeps every row still needed, so the entries of the
    accepted tokens equal a run that never saw the drafts, bit for bit."""
    spec = CompressorSpec(4, True, 16, 4, "bf16", requests=1, max_decode_len=4, page=2,
                          max_entries=16)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with_drafts = [(4, 1), (4, 3), (4, 4), (4, 2), (4, 1), (4, 4), (4, 2), (4, 3)]
    total = sum(a for _, a in with_drafts)
    stream_kv = torch.randn(total + 4, spec.width, generator=g).bfloat16()
    stream_gate = torch.randn(total + 4, spec.width, generator=g).bfloat16()
    clean = [(a, a) for _, a in with_drafts]
    a = _stream_run(spec, stream_kv, stream_gate, with_drafts, g, seed + 1)
    b = _stream_run(spec, stream_kv, stream_gate, clean, g, seed + 2)
    bt = a.block_table.cpu()[0]
    final = [int(bt[k // spec.page]) * spec.page + k % spec.page for k in range(total // 4)]
    rows_a, rows_b = (p.cache.cpu().view(-1, spec.dim)[final] for p in (a, b))
    assert torch.equal(rows_a, rows_b)
    assert not torch.isnan(rows_a.float()).any()


def test_padding_requests_and_rows_touch_nothing(seed):
    """n = 0, positions below 0 (seq_lens < n), a state index of -1 or past the states, and
    rows past the requests' (NaN, never read) append and write nothing."""
    spec = CompressorSpec(2, True, 16, 4, "bf16", requests=4, max_decode_len=3, page=2)
    g = torch.Generator().manual_seed(seed)
    problem = compressor_problem(g, spec, DEV, start_lengths=[0, 0, 5, 4])
    problem.state.kv.fill_(float("nan"))
    problem.state.gate.fill_(float("nan"))
    states = problem.state.kv.shape[0]
    problem.state_index = torch.tensor([0, 1, -1, states + 2], dtype=I32, device=DEV)
    step = compressor_step_inputs(g, problem, [0, 3, 3, 3], extra_rows=2)
    step.kv[-2:] = float("nan")
    step.seq_lens[1] = 1  # rows at positions -2, -1, 0: only the last is a token
    cache_before = problem.cache.clone()
    run_compressor_step(problem, step)
    ring = problem.state.kv.cpu()
    assert torch.isnan(ring[0]).all() and torch.isnan(ring[2:]).all()
    assert torch.equal(ring[1, 0], step.kv[2].cpu())  # position 0 of request 1 (its row 2)
    assert torch.isnan(ring[1, 1:]).all()
    assert torch.equal(problem.state.gate.isnan(), problem.state.kv.isnan())
    assert torch.equal(problem.cache.view(torch.int16), cache_before.view(torch.int16))
    after = problem.state.kv.clone()
    uniform = compressor_step_inputs(g, problem, [0], uniform=True)
    assert uniform.decode_len == 0 and uniform.kv.shape[0] == 0
    run_compressor_step(problem, uniform)  # nothing to launch
    assert torch.equal(problem.state.kv.nan_to_num(7.0), after.nan_to_num(7.0))


def test_strided_state_block_table_and_weights(seed):
    """Rings inside wider buffers, a transposed block table, strided weights and table."""
    spec = CompressorSpec(4, True, 16, 8, "fp8", requests=3)
    g = torch.Generator().manual_seed(seed)
    problem = compressor_problem(g, spec, DEV)
    s, r, w = problem.state.kv.shape
    for name in ("kv", "gate"):
        wide = torch.full((s, r + 2, w + 5), float("nan"), dtype=spec.dtype, device=DEV)
        view = wide[:, 1 : r + 1, 2 : w + 2]
        view.copy_(getattr(problem.state, name))
        problem.state = problem.state._replace(**{name: view})
    problem.block_table = problem.block_table.t().contiguous().t()
    problem.position_bias = torch.stack([problem.position_bias] * 2, -1)[..., 1]
    problem.norm_weight = torch.stack([problem.norm_weight] * 2, 1)[:, 1]
    problem.cos_sin = torch.stack([problem.cos_sin] * 2, 1)[:, 0]
    for _ in range(3):
        lens = random_decode_lens(g, spec)
        step = compressor_step_inputs(g, problem, lens, strided=True)
        assert check_compressor_step(problem, step) is None


# ---- fp8: the bytes of the same pooled rows ---------------------------------------------------


@pytest.mark.parametrize("cache", ["fp8", "model1_fp8"])
def test_fp8_bytes_equal_the_writer_of_the_same_pooled_rows(cache, seed):
    """The same step into a bf16 twin and the fp8 cache: the fp8 bytes are the reference
    writer's for the bf16 entries (quantisation bit-exact given the pooled rows)."""
    d = 512 if cache == "model1_fp8" else 128
    spec = CompressorSpec(4, True, d, 64, cache, requests=2, max_decode_len=4)
    g = torch.Generator().manual_seed(seed)
    problem = compressor_problem(g, spec, DEV)
    twin = dataclasses.replace(problem, spec=dataclasses.replace(spec, cache="bf16"))
    twin.cache = torch.zeros(*problem.cache.shape[:2], d, dtype=torch.bfloat16, device=DEV)
    twin.cache_base = storage_bytes(twin.cache)
    twin.state = type(problem.state)(problem.state.kv.clone(), problem.state.gate.clone())
    step = compressor_step_inputs(g, problem, [4] * spec.requests)
    expected = problem.cache.clone()
    run_compressor_step(problem, step)
    run_compressor_step(twin, step)
    slots = (twin.cache.view(-1, d) != 0).any(1).nonzero().flatten()
    assert len(slots) >= spec.requests, "no entry was written"
    write_entries_reference(twin.cache.view(-1, d)[slots].double(), slots, expected)
    assert torch.equal(problem.cache, expected)


# ---- helpers and bad input --------------------------------------------------------------------


def test_state_rows_and_new_state():
    assert compressor_state_rows(4, True, 4) == 11  # CSA, MTP 4
    assert compressor_state_rows(128, False, 4) == 131  # HCA
    assert window_span(4, True) == 8
    st = new_compressor_state(3, 1024, compress_rate=4, overlap=True, max_decode_len=2,
                              gate_dtype=torch.float32, device=DEV)  # fmt: skip
    assert st.kv.shape == (3, 9, 1024) and st.kv.dtype == torch.bfloat16
    assert st.gate.dtype == torch.float32
    table = compressor_rope_table(torch.tensor([1.0, 0.5]), 3, attention_scaling=2.0)
    angles = torch.tensor([2.0, 1.0])  # position 2 times each inverse frequency
    torch.testing.assert_close(table[2], 2 * torch.cat([angles.cos(), angles.sin()]))


def test_pool_launch_pins_the_measured_shapes():
    """V4's windows as swept on the H200 (docs/PERF.md): HCA's 128 rows 64 a step with 16
    warps, the 8-row windows of CSA and the indexer in one step with 4."""
    assert compressor_api.pool_launch(128) == (64, 16)
    assert compressor_api.pool_launch(8) == (8, 4)
    assert compressor_api.pool_launch(128, interpreter=True) == (128, 4)


@pytest.mark.parametrize("rows", [8, 64])
def test_windows_pooled_in_several_steps(rows: int, monkeypatch):
    """HCA's 128-row windows pooled ``rows`` at a time, as on the GPU (``pool_launch``: 64),
    where the interpreter otherwise takes a window in one step: the online softmax across
    steps (ring rows and this step's, a request with two rows) against the reference."""
    monkeypatch.setattr(compressor_api, "pool_launch", lambda span, interpreter=False: (rows, 4))
    clear_host_plans()
    try:
        spec = dataclasses.replace(V4_SPECS["hca"], requests=2, max_decode_len=2)
        g = torch.Generator().manual_seed(rows)
        problem = compressor_problem(g, spec, DEV, start_lengths=[127, 254])
        step = compressor_step_inputs(g, problem, [1, 2])
        assert check_compressor_step(problem, step) is None
    finally:
        clear_host_plans()


def _args(spec=None):
    spec = spec or CompressorSpec(4, True, 16, 4, "bf16", requests=2, max_decode_len=2)
    g = torch.Generator().manual_seed(0)
    problem = compressor_problem(g, spec, DEV)
    step = compressor_step_inputs(g, problem, [2, 2])
    args = dict(
        kv=step.kv, gate=step.gate, state_kv=problem.state.kv, state_gate=problem.state.gate,
        cache=problem.cache, seq_lens=step.seq_lens, block_table=problem.block_table,
        position_bias=problem.position_bias, norm_weight=problem.norm_weight,
        cos_sin=problem.cos_sin, compress_rate=4, overlap=True, max_decode_len=2,
        query_start_loc=step.query_start_loc,
    )  # fmt: skip
    return args


def _both(name, make):
    """Replace the kv/gate (or state_kv/state_gate) pair alike."""
    other = {"kv": "gate", "state_kv": "state_gate"}[name]
    return lambda a: {name: make(a[name]), other: make(a[other])}


BAD = [
    ("kv", lambda a: a["kv"].half(), TypeError, "state_kv"),
    ("gate", lambda a: a["gate"][:2], ValueError, "gate"),
    ("kv", _both("kv", lambda t: torch.zeros(4, 40, device=DEV)), ValueError, "power of two"),
    ("gate", lambda a: a["gate"].int(), TypeError, "gate"),
    ("state_kv", _both("state_kv", lambda t: t[:, :8]), ValueError, "ring rows"),
    ("state_kv", lambda a: a["state_kv"][:, :, :16], ValueError, "state_kv"),
    ("state_gate", lambda a: a["state_gate"].float(), TypeError, "state_gate"),
    ("state_kv", _both("state_kv", lambda t: t[:, :1].expand(-1, 12, -1)), ValueError,
     "overlap"),
    ("cache", lambda a: torch.zeros(4, 4, 32, dtype=torch.bfloat16, device=DEV), ValueError,
     "16 wide"),
    ("cache", lambda a: a["cache"].float(), TypeError, "cache"),
    ("seq_lens", lambda a: a["seq_lens"].long(), TypeError, "seq_lens"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, "block_table"),
    ("query_start_loc", lambda a: a["query_start_loc"][:2], ValueError, "query_start_loc"),
    ("query_start_loc", lambda a: None, ValueError, "exactly one"),
    ("position_bias", lambda a: a["position_bias"][:2], ValueError, "position_bias"),
    ("norm_weight", lambda a: a["norm_weight"][:8], ValueError, "norm_weight"),
    ("cos_sin", lambda a: a["cos_sin"][:, :3], ValueError, "cos_sin"),
    ("cos_sin", lambda a: torch.zeros(4, 18, device=DEV), ValueError, "cos_sin"),
    ("compress_rate", lambda a: 0, ValueError, "compress_rate"),
    ("overlap", lambda a: 1, TypeError, "overlap"),
    ("max_decode_len", lambda a: 0, ValueError, "max_decode_len"),
    ("eps", lambda a: float("nan"), ValueError, "eps"),
    ("state_index", lambda a: torch.zeros(3, dtype=I32, device=DEV), ValueError, "state_index"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "exc", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, make, exc, match):
    args = _args()
    new = make(args)
    args.update(new if isinstance(new, dict) else {name: new})
    with pytest.raises(exc, match=match):
        compressor_decode(**args)


def test_bad_layouts():
    args = _args()
    with pytest.raises(ValueError, match="exactly one"):
        compressor_decode(**args, decode_len=2)
    args.pop("query_start_loc")
    with pytest.raises(ValueError, match="decode_len"):
        compressor_decode(**args, decode_len=3)  # more than the rows
    with pytest.raises(ValueError, match="overlaps"):
        compressor_decode(**dict(args, gate=args["state_kv"][0, :4, :32]), decode_len=2)
    cache = new_indexer_k_cache(4, 4, head_dim=32, fp8=True, device=DEV)
    with pytest.raises(ValueError, match="16 wide"):
        compressor_decode(**dict(args, cache=cache), decode_len=2)
    spec = CompressorSpec(4, True, 32, 4, "bf16", requests=2, max_decode_len=2)
    model1 = _args(spec)
    model1["cache"] = torch.zeros(2, 4, 1, 584, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="MODEL1"):
        compressor_decode(**model1)


def test_op_path_equals_the_public_function():
    """``torch.ops.sparse_mla.compressor_decode`` (torch.compile's path) writes what the
    public function writes."""
    from sparse_mla import library
    from sparse_mla.testing.compressor import compressor_op_args

    args = compressor_op_args(DEV)
    names = ("kv", "gate", "state_kv", "state_gate", "cache", "seq_lens", "block_table",
             "position_bias", "norm_weight", "cos_sin", "compress_rate", "overlap",
             "max_decode_len", "eps", "query_start_loc", "decode_len", "state_index")  # fmt: skip
    results = []
    for fn in (compressor_decode, library.compressor_decode):
        kw = dict(zip(names, args, strict=True))
        for name in ("state_kv", "state_gate", "cache"):
            kw[name] = kw[name].clone()
        positional = [kw.pop(n) for n in names[:10]]
        fn(*positional, **kw)
        results.append(positional[2:5])
    for want, got in zip(*results, strict=True):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    assert not torch.equal(results[0][2], args[4])  # an entry was written
