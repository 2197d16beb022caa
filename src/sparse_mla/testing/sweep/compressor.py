"""Random checks of DeepSeek-V4's compressors (``compressor_decode``): a few steps of ragged
MTP rows (rejected drafts, padding, strided inputs) against the float64 reference, through
the kit's problems (:mod:`sparse_mla.testing.compressor`)."""

from __future__ import annotations

import dataclasses

import torch

from ...ops.compressor import compressor_decode
from ..compressor import (
    V4_SPECS,
    CompressorSpec,
    check_compressor_step,
    compressor_problem,
    compressor_step_inputs,
    random_accepted,
    random_decode_lens,
)
from .draw import Case, rand_choice, rand_int

# Interpreter shapes: the three compressors' rules, HCA and the indexer at small widths.
QUICK_SPECS = {
    "csa": CompressorSpec(4, True, 512, 64, "model1_fp8"),
    "hca": CompressorSpec(16, False, 32, 8, "bf16"),
    "indexer": CompressorSpec(4, True, 16, 8, "fp8"),
}


def _spec(case: Case, g: torch.Generator) -> CompressorSpec:
    p = case.params
    spec = (QUICK_SPECS if p["quick"] else V4_SPECS)[p["compressor"]]
    return dataclasses.replace(
        spec,
        cache=p["cache"],
        requests=rand_int(g, 1, (2 if spec.dim > 128 else 4) if p["quick"] else 16),
        max_decode_len=rand_int(g, 1, 4),
        page=rand_choice(g, (2, 4, 64) if p["quick"] else (64,)),
        max_entries=8 if p["quick"] and spec.compress_rate > 4 else 24,
        hostile=rand_int(g, 0, 2) == 0,
    )


def check_compressor(case: Case, g: torch.Generator, dev: torch.device) -> str | None:
    spec = _spec(case, g)
    problem = compressor_problem(g, spec, dev)
    for s in range(case.params["steps"]):
        lens = random_decode_lens(g, spec)
        step = compressor_step_inputs(
            g, problem, lens, uniform=s == 1, extra_rows=rand_int(g, 0, 2), strided=s % 2 == 0
        )
        err = check_compressor_step(
            problem, step, random_accepted(g, step.decode_lens), fn=compressor_decode
        )
        if err:
            return f"step {s}: {err}"
    return None
