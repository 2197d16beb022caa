"""Record one launch of each kind of the DCP kernels (interpreter, one gloo rank) in the
format of ``tests/kernel_compile.py``, whose ``compile`` step then builds them for GPU targets.

    python tests/dcp/record_launches.py LAUNCHES.json
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

MODULES = ("sparse_mla.dcp.topk", "sparse_mla.dcp.combine")


def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ["ptr", str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    return ["float", value] if isinstance(value, float) else ["const", repr(value)]


def record(path: str) -> int:
    import importlib

    import torch
    import torch.distributed as dist

    from sparse_mla import dcp

    # isort: split
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, dict] = {}

    class Recorder:
        def __init__(self, module: str, name: str, kernel) -> None:
            self.module, self.name, self.kernel = module, name, kernel

        def __call__(self, *args, **kwargs):
            return self.kernel(*args, **kwargs)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.kernel[grid](*args, **kwargs)
                entry = {
                    "module": self.module,
                    "kernel": self.name,
                    "args": [_describe(a) for a in args],
                    "kwargs": {k: _describe(v) for k, v in sorted(kwargs.items())},
                }
                kinds = [a[0] for a in entry["args"]]
                key = json.dumps([self.module, self.name, entry["kwargs"], kinds])
                launches.setdefault(key, entry)

            return launch

    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, InterpretedFunction):
                setattr(module, attr, Recorder(name, attr, value))

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    group = dist.group.WORLD
    x, lens = torch.randn(2, 300), torch.tensor([300, 5], dtype=torch.int32)
    for mode in ("exact", "union"):
        kw = dict(k=128, dcp_size=1, dcp_rank=0, interleave=1, group=group, mode=mode)
        dcp.global_topk(x, lens, **kw)
    for dtype in (torch.bfloat16, torch.float32):
        for reduce in ("all_reduce", "reduce_scatter_heads"):
            dcp.combine(
                torch.randn(2, 16, 40).to(dtype), torch.randn(2, 16), group=group, reduce=reduce
            )
    # More than one rank (the merge's rank loop, the combine's rank vector).
    cands = torch.full((3, 2, 2, 128), -1, dtype=torch.int32)
    dcp.merge_topk_candidates(cands, k=128)
    out, lse_all = torch.randn(2, 16, 40), torch.randn(3, 2, 16)
    dest, lse_out = torch.empty(2 * 16 * 40), torch.empty(2, 16)
    dcp.rescale_partial(out, lse_all, dcp_rank=2, dest=dest, lse_out=lse_out)
    dist.destroy_process_group()
    with open(path, "w") as f:
        json.dump(list(launches.values()), f, indent=1)
    print(f"recorded {len(launches)} kinds of launch")
    return 0


if __name__ == "__main__":
    sys.exit(record(sys.argv[1]))
