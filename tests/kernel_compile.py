"""Compile every kernel launch of the quick verification sweep for GPU targets, on a CPU.

The interpreter that runs the test suite is not the compiler: some code runs there and not
on a GPU. An integer argument equal to 1, for example, becomes a compile-time constant on
the GPU (Triton specialises it), so ``n.to(...)`` on it compiles in the interpreter and
fails on the GPU; and Triton has no e4m3 before sm_89. This script has two steps, each in its
own process, because the execution mode is fixed when Triton is first imported:

    python tests/kernel_compile.py record LAUNCHES.json [--part=I/N]   # interpreter
    TRITON_INTERPRET=0 python tests/kernel_compile.py compile LAUNCHES.json... \
        [--targets=all|sm_90,sm_80,gfx942,...] [--sample=sm_86,...] [--part=I/N]

``--part=I/N`` (e.g. ``0/2``) runs every N-th case from the I-th (or compiles every N-th kind of
launch), so that several processes share the work. ``--sample=`` names targets that compile
only each kernel's first launch of each cache format (``_sample``), as recorded.

``record`` runs ``sparse-mla verify --quick``'s cases (which must pass) with every kernel
wrapped by a recorder, and keeps one launch of each kind: the kernel, its argument types,
the compile-time constants and the warps. ``compile`` builds each kind of launch for each
target (default: all of ``TARGETS``) as a GPU launch there would: with every integer
argument equal to 1 (Triton makes such an argument a constant), and once per kernel with
none; ``PDL`` as on Hopper where the target has it (sm_90 on); on a target without e4m3
(before sm_89) as the wrappers launch there: fp8 tensors passed as bytes, ``E4M3_BITS`` on.
A ``sm_NN`` target compiles down to a cubin with Triton's NVIDIA backend, a ``gfxNNN`` one
down to an hsaco with its AMD backend (both in the PyPI wheel); neither needs a GPU or a
toolkit.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

MODULES = (
    "sparse_mla.ops.decode_metadata.expand",
    "sparse_mla.ops.remap.remap",
    "sparse_mla.ops.topk.radix",
    "sparse_mla.ops.topk.prefilter",
    "sparse_mla.ops.indexer.logits",
    "sparse_mla.ops.kv_cache.write",
    "sparse_mla.ops.attention.split_kv",
    "sparse_mla.ops.kv_cache.model1",
    "sparse_mla.ops.attention.combine",
    "sparse_mla.ops.compressor.gated_pool",
    "sparse_mla.decode.v4_rows",
)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
# The targets CI compiles for (README, "Supported GPUs"): NVIDIA Ampere (A100, RTX 30xx), Ada,
# Hopper, Blackwell (B200, RTX 50xx), and AMD CDNA3 (MI300).
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942")


def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ["ptr", str(value.dtype).removeprefix("torch.")]
    if value is None:
        return ["none"]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    return ["const", value if isinstance(value, str) else repr(value)]


def _part(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    part, parts = (int(v) for v in text.split("/"))
    assert 0 <= part < parts, text
    return part, parts


def _key(entry: dict) -> str:
    # Launches that differ only in integer values compile alike but for the integers a GPU
    # launch turns into the constant 1 (compile_all's two cases).
    kinds = [a[0] for a in entry["args"]]
    return json.dumps([entry["module"], entry["kernel"], entry["kwargs"], kinds])


def record(path: str, part: str | None = None) -> int:
    from sparse_mla import verify

    # isort: split
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, dict] = {}

    class Recorder:
        def __init__(self, module: str, name: str, kernel) -> None:
            self.module, self.name, self.kernel = module, name, kernel

        def __call__(self, *args, **kwargs):  # a helper called from another kernel
            return self.kernel(*args, **kwargs)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.kernel[grid](*args, **kwargs)  # the case goes on to its other launches
                entry = {
                    "module": self.module,
                    "kernel": self.name,
                    "args": [_describe(a) for a in args],
                    "kwargs": {k: _describe(v) for k, v in sorted(kwargs.items())},
                }
                launches.setdefault(_key(entry), entry)

            return launch

    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, InterpretedFunction):
                setattr(module, attr, Recorder(name, attr, value))

    dev = verify.default_device()
    i, n = _part(part)
    cases = verify.build_cases(quick=True)[i::n]
    failed = [c.label() for c in cases if verify.run_case(c, dev) is not None]
    assert not failed, f"verify cases failed while recording: {failed[:3]}"
    if i == 0:
        _launch_the_rest()
    with open(path, "w") as f:
        json.dump(list(launches.values()), f, indent=1)
    print(f"recorded {len(launches)} kinds of launch")
    return 0


def _launch_the_rest() -> None:
    """The kernels the sweep does not reach: native lengths (also the builder's), DCP, and
    the remap's layouts for large calls (flat) and whole-row staging."""
    import torch

    from sparse_mla import RemapConfig, convert_req_index_to_global_index
    from sparse_mla.ops.decode_metadata import (
        DecodeMetadataBuilder,
        dcp_local_seq_lens,
        native_decode_seq_lens,
    )

    i32 = dict(dtype=torch.int32)
    for k, layout in (
        (384, RemapConfig(4, 512, 3, 1, False, True, 4, evict_first=True, pdl=2, flat=True)),
        (2048, RemapConfig(1, 2048, 1, 1, False, True, 16, stage_row=True, flat=True)),
    ):
        for prefill, counts in ((None, True), (None, False), (torch.full((3,), -1, **i32), True)):
            convert_req_index_to_global_index(
                torch.zeros(3, **i32),
                torch.zeros(1, 4, **i32),
                torch.full((3, k), 5, **i32),
                prefill_request_ids=prefill,
                prefill_workspace_starts=None if prefill is None else torch.zeros(1, **i32),
                return_valid_counts=counts,
                layout=layout,
            )

    for reqs in (1, 3):
        lens = torch.arange(5, 5 + reqs, dtype=torch.int32)
        for dcp in (1, 2):
            native_decode_seq_lens(lens, next_n=2, dcp_size=dcp, dcp_rank=dcp - 1)
            dcp_local_seq_lens(lens, dcp_size=2, dcp_rank=1, interleave=dcp)
            builder = DecodeMetadataBuilder(8, 4, 4, 2, native_decode_lens=(2,), dcp_size=dcp)
            builder.build(lens, torch.zeros(reqs, 4, dtype=torch.int32), [2] * reqs)

    _compressor_gpu_launch()


def _compressor_gpu_launch() -> None:
    """One HCA step with the GPU's pooling shape (``pool_launch`` off the interpreter: 64 rows
    a step, 16 warps), which the interpreter's sweep never launches."""
    import dataclasses

    import torch

    from sparse_mla._launch import clear_host_plans
    from sparse_mla.ops.compressor import api
    from sparse_mla.testing.compressor import (
        V4_SPECS,
        compressor_problem,
        compressor_step_inputs,
        run_compressor_step,
    )

    choose = api.pool_launch
    api.pool_launch = lambda span, interpreter=False: choose(span)
    clear_host_plans()
    try:
        spec = dataclasses.replace(V4_SPECS["hca"], requests=1, max_decode_len=1)
        g = torch.Generator().manual_seed(0)
        problem = compressor_problem(g, spec, "cpu", start_lengths=[127])
        run_compressor_step(problem, compressor_step_inputs(g, problem, [1]))
    finally:
        api.pool_launch = choose
        clear_host_plans()


_POINTER = {
    "int32": "*i32",
    "int64": "*i64",
    "int8": "*i8",
    "uint8": "*u8",
    "float32": "*fp32",
    "float16": "*fp16",
    "bfloat16": "*bf16",
    "float8_e4m3fn": "*fp8e4nv",
}


def _target(name: str):
    """``sm_NN`` (NVIDIA, warps of 32) or ``gfxNNN`` (AMD: CDNA's wavefronts of 64, RDNA's 32)."""
    from triton.backends.compiler import GPUTarget

    if name.startswith("sm_"):
        return GPUTarget("cuda", int(name[3:]), 32)
    assert name.startswith("gfx"), f"unknown target {name}"
    return GPUTarget("hip", name, 64 if name.startswith("gfx9") else 32)


def _signature(fn, entry: dict, ones: bool, target) -> tuple[dict, dict, dict]:
    """Triton's signature, constants and attributes for one launch, as on ``target``.

    ``ones``: every integer argument specialised to the constant 1. Otherwise as a GPU launch
    of the recorded values specialises them: integers equal to 1 become constants, pointers
    and integers divisible by 16 are marked so (``tt.divisibility``), which changes the
    vectorisation and layouts the compiler picks (a Triton 3.6 layout bug showed only so);
    kernels' ``INTERPRET`` switch is off, as on a GPU. Constants a launch leaves out keep
    their defaults."""
    from sparse_mla._runtime import target_has_e4m3

    nvidia = target.backend == "cuda"
    e4m3_bits = not target_has_e4m3(target) and "E4M3_BITS" in fn.arg_names
    values = dict(zip(fn.arg_names, entry["args"], strict=False))
    values.update({k: v for k, v in entry["kwargs"].items() if k not in LAUNCH_OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        kind, *rest = values.get(p.name) or ["const", p.default]
        value = rest[0] if rest else None
        if p.is_constexpr or kind in ("none", "const") or (kind == "int" and (ones or value == 1)):
            value = 1 if kind == "int" and not p.is_constexpr else value
            if p.name == "PDL":  # the programmatic-dependent-launch code, where it exists
                value = int(nvidia and target.arch >= 90)
            if p.name == "INTERPRET":
                value = False  # recorded under the interpreter; the GPU compiles the other branch
            if p.name == "E4M3_BITS":
                value = e4m3_bits
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif kind == "ptr":
            byte = e4m3_bits and value == "float8_e4m3fn"  # the wrappers pass bytes there
            signature[p.name] = "*u8" if byte else _POINTER[value]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-aligned
        elif kind == "int":
            signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "bool":
            signature[p.name] = "i1"
        else:
            signature[p.name] = "fp32"
    return signature, constexprs, attrs


def _compile_one(fn, entry: dict, ones: bool, target) -> str | None:
    """None if the launch compiles for ``target``, else why not."""
    import triton
    from triton.compiler import ASTSource

    kw = entry["kwargs"]
    options = {k: kw[k][1] for k in ("num_warps", "num_stages") if k in kw}
    signature, constexprs, attrs = _signature(fn, entry, ones, target)
    try:
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
    except Exception as e:  # noqa: BLE001  (report every failure, then fail)
        return f"{type(e).__name__}: {str(e)[:2000]}"
    return None


def _sample(launches: list[dict]) -> list[dict]:
    """Each kernel's first launch of each cache format (its ``FP8`` and ``MODEL1`` constants,
    where it has them): a tenth of the launches, every kernel and e4m3 reader among them."""
    first: dict[str, dict] = {}
    for entry in launches:
        kw = entry["kwargs"]
        first.setdefault(json.dumps([entry["kernel"], kw.get("FP8"), kw.get("MODEL1")]), entry)
    return list(first.values())


def compile_all(
    paths: list[str], targets: list[str], sampled: list[str], part: str | None = None
) -> int:
    """Compile the launches for each target (``sampled`` ones: :func:`_sample` only)."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"
    launches: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            for entry in json.load(f):
                launches.setdefault(_key(entry), entry)
    i, n = _part(part)
    every = list(launches.values())
    failed = 0
    for name in targets:
        target = _target(name)
        chosen = (_sample(every) if name in sampled else every)[i::n]
        # Each kind of launch specialised as its recorded values would be on a GPU, and each
        # kernel's first also with every integer argument 1 (not on a sampled target: what
        # the integers change is the front end's, the same for every target).
        seen, total, bad, t0 = set(), 0, {}, time.time()
        for entry in chosen:
            fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
            first = entry["kernel"] not in seen and name not in sampled
            for ones in (False, True) if first else (False,):
                seen.add(entry["kernel"])
                total += 1
                why = _compile_one(fn, entry, ones, target)
                if why is not None:
                    bad[entry["kernel"]] = bad.get(entry["kernel"], 0) + 1
                    print(f"FAIL {name} {entry['kernel']} ones={ones}\n  {why}")
        failed += sum(bad.values())
        print(f"{name}: {total - sum(bad.values())}/{total} launches of {len(seen)} kernels "
              f"compiled in {time.time() - t0:.0f}s"
              + (f"; failing: {', '.join(f'{k} ({v})' for k, v in sorted(bad.items()))}"
                 if bad else ""))  # fmt: skip
    return 1 if failed else 0


def _option(args: list[str], name: str) -> str | None:
    """The value of ``--name=VALUE`` among ``args`` (removed from them), or None."""
    for a in args:
        if a.startswith(f"--{name}="):
            args.remove(a)
            return a.split("=", 1)[1]
    return None


if __name__ == "__main__":
    step, args = sys.argv[1], sys.argv[2:]
    part = _option(args, "part")
    targets = _option(args, "targets") or "all"
    targets = list(TARGETS) if targets == "all" else targets.split(",")
    sampled = (_option(args, "sample") or "").split(",")
    if step == "record":
        sys.exit(record(args[0], part))
    sys.exit(compile_all(args, targets, sampled, part))
