"""sparse_mla.warmup / `sparse-mla warmup`: the launches of a configuration's decode step,
run ahead of the first request (under the interpreter: once, at a tiny size)."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

import sparse_mla
from sparse_mla import _runtime
from sparse_mla.cli import main as cli_main
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.decode.warmup import DEFAULT_BATCH_SIZES
from sparse_mla.testing.cases import random_step

pytestmark = pytest.mark.skipif(not _runtime.INTERPRETER, reason="the interpreter's launches")


def _spec(v: object) -> object:
    """A launch argument as Triton specialises it: tensors by dtype, ints by 1 / 16 | v,
    floats by type only."""
    if isinstance(v, torch.Tensor):
        return str(v.dtype)
    if isinstance(v, float):
        return "float"
    if isinstance(v, int) and not isinstance(v, bool):
        return "one" if v == 1 else "16x" if v % 16 == 0 else "int"
    return v


@contextmanager
def _recording(monkeypatch):
    """The set of (kernel, argument specialisations) launched inside the block."""
    seen: set = set()
    run = _runtime._InterpretedKernel.run

    def recorded(self, *args, grid, warmup, **kwargs):
        spec = tuple(map(_spec, args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items()))
        seen.add((self.fn.__name__, *spec))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(_runtime._InterpretedKernel, "run", recorded)
    yield seen
    monkeypatch.undo()


@pytest.mark.parametrize(
    "cache_format, decode_len, remap", [("fp8", 1, "topk"), ("bf16", 2, "attention")]
)
def test_warmup_launches_what_a_step_of_its_configuration_launches(
    monkeypatch, cache_format, decode_len, remap
):
    opts = dict(num_heads=4, cache_format=cache_format, topk=64, block_size=16)
    with _recording(monkeypatch) as warmed:
        report = sparse_mla.warmup(**opts, num_pages=5, decode_len=decode_len, remap=remap)
    assert report.mode == "interpreter" and report.seconds > 0
    assert report.token_counts == (decode_len,) and report.max_seq_len == 32  # two pages
    assert report.compiled is None and report.again_seconds is None
    assert "interpreter" in report.summary() and f"T = {decode_len}" in report.summary()

    # A real step of that size: random data, a shuffled block table, a shorter request.
    case = random_step(random.Random(0), seq_lens=[27], decode_lens=[decode_len], num_heads=4,
                       block_size=16, fp8=cache_format == "fp8", max_blocks=2,
                       num_pages=5)  # fmt: skip
    cfg = DecodePlanConfig(decode_len, 1, 2, 4, topk=64, max_decode_len=decode_len,
                           block_size=16, mla_fp8=cache_format == "fp8", remap=remap)  # fmt: skip
    plan, x = DecodePlan(cfg, sm_scale=0.1), case.inputs
    with _recording(monkeypatch) as stepped:
        plan.run(x, case.decode_lens)
    with _recording(monkeypatch) as int64_slots:  # as vLLM and SGLang hand them out
        plan.run(x._replace(slot_mapping=x.slot_mapping.long()), case.decode_lens)
    assert len(stepped) >= 4  # writers, logits, top-k, attention at least
    assert stepped != int64_slots and warmed == stepped | int64_slots


def test_recording_tells_launches_apart(monkeypatch):
    """The comparison above can fail: another cache format launches other specialisations."""
    opts = dict(num_heads=4, topk=64, block_size=16, num_pages=5)
    with _recording(monkeypatch) as fp8:
        sparse_mla.warmup(**opts, cache_format="fp8")
    with _recording(monkeypatch) as bf16:
        sparse_mla.warmup(**opts, cache_format="bf16")
    assert fp8 != bf16


def test_page_counts_are_warmed_by_their_class(monkeypatch):
    """The indexer kernel is specialised on the page count (multiple of 16 or not): a step
    over 48 pages launches what num_pages=32 warmed, not what 5 did; None warms both."""
    opts = dict(num_heads=4, topk=64, block_size=16)
    warmed = {}
    for pages in (5, 32, None):
        with _recording(monkeypatch) as warmed[pages]:
            sparse_mla.warmup(**opts, num_pages=pages)
    case = random_step(random.Random(1), seq_lens=[20], decode_lens=[1], num_heads=4,
                       block_size=16, fp8=True, max_blocks=2, num_pages=48)  # fmt: skip
    cfg = DecodePlanConfig(1, 1, 2, 4, topk=64, max_decode_len=1, block_size=16)
    with _recording(monkeypatch) as stepped:
        DecodePlan(cfg, sm_scale=0.1).run(case.inputs, case.decode_lens)
    assert stepped <= warmed[32] and not stepped <= warmed[5]
    assert warmed[None] == warmed[5] | warmed[32]


def test_ragged_adds_the_flattened_rows_launches(monkeypatch):
    opts = dict(num_heads=4, topk=64, block_size=16, decode_len=2, num_pages=5)
    with _recording(monkeypatch) as uniform:
        sparse_mla.warmup(**opts)
    with _recording(monkeypatch) as ragged:
        report = sparse_mla.warmup(**opts, ragged=True)
    assert report.token_counts == (4,)  # two requests of two tokens
    names = {launch[0] for launch in ragged - uniform}
    assert "_expand_kernel" in names, names  # the flattening


def test_cli_warmup(capsys):
    assert cli_main(["warmup", "--heads", "4", "--topk", "64", "--page", "16", "--pages", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("warm-up (interpreter") and " s" in out
    with pytest.raises(SystemExit) as stop:
        cli_main(["warmup", "--tokens", "3", "--decode-len", "2"])
    assert stop.value.code == 2 and "multiple of decode_len=2" in capsys.readouterr().err


def test_default_token_counts_follow_decode_len():
    from sparse_mla.decode.warmup import _check_options

    opts = dict(num_heads=8, cache_format="fp8", block_size=64, max_seq_len=4096,
                num_pages=None, ragged=False, graphs=True, token_counts=None)  # fmt: skip
    assert _check_options({**opts, "decode_len": 2}) == tuple(2 * b for b in DEFAULT_BATCH_SIZES)
    assert _check_options({**opts, "decode_len": 1, "token_counts": [3, 5]}) == (3, 5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_heads": 0}, ValueError, "num_heads"),
        ({"num_heads": 129}, ValueError, "num_heads"),
        ({"cache_format": "fp16"}, ValueError, "cache_format"),
        ({"decode_len": 9}, ValueError, "decode_len"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"num_pages": 0}, ValueError, "num_pages"),
        ({"max_seq_len": 2.5}, TypeError, "max_seq_len"),
        ({"token_counts": []}, ValueError, "token_counts is empty"),
        ({"token_counts": [0]}, ValueError, "token_counts entry"),
        ({"token_counts": [3], "decode_len": 2}, ValueError, "multiple of decode_len"),
        ({"ragged": 1}, TypeError, "ragged"),
        ({"graphs": "no"}, TypeError, "graphs"),
        ({"topk": 0}, ValueError, "topk"),
        ({"remap": "fused"}, ValueError, "remap"),
    ],
)
def test_warmup_rejects_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        sparse_mla.warmup(**{"num_heads": 4, **kwargs})
