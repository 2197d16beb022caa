"""FlashMLA's own sparse decode tests (``tests/test_flash_mla_sparse_decoding.py`` of
deepseek-ai/FlashMLA) run against our drop-in ``sparse_mla.compat.flashmla`` (``--impl
ours``) or against FlashMLA itself (``--impl flashmla``, to check this runner).

    FLASHMLA_TESTS=<FlashMLA checkout>/tests PYTHONPATH=src python \\
        benchmarks/flashmla_own_tests.py --impl ours [--d-qk 512] [--budget 120]

Their correctness and corner cases (V3.2's d_qk 576 and V4's MODEL1 d_qk 512, with the second
index set, ``topk_length`` / ``extra_topk_length``, sinks, all-invalid ids, zero lengths), each
built and checked by their code (their generator, reference and tolerances), in a fixed
shuffled order until ``--budget`` seconds have passed. Their performance cases are skipped
(they time FlashMLA's kernels by name). Prints the counts and every failing case; exit 1 on a
failure. Nothing of FlashMLA is copied here: the tests are imported from the checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import sys
import time
import types


def _stub_rich() -> None:
    """Their module imports ``rich`` for its summary table, which this runner does not print."""
    try:
        import rich.console  # noqa: F401
        import rich.table  # noqa: F401
    except ImportError:
        rich = types.ModuleType("rich")
        rich.console = types.ModuleType("rich.console")
        rich.table = types.ModuleType("rich.table")
        sys.modules.update({"rich": rich, "rich.console": rich.console, "rich.table": rich.table})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=("ours", "flashmla"), default="ours")
    ap.add_argument("--d-qk", type=int, choices=(512, 576), default=None)
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    sys.path.insert(0, os.environ["FLASHMLA_TESTS"])
    _stub_rich()
    if args.impl == "ours":
        from sparse_mla.compat import flashmla

        sys.modules["flash_mla"] = flashmla
    import test_flash_mla_sparse_decoding as upstream

    # As their main() does: bf16 and the GPU by default.
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda:0")
    cases = [c for c in upstream.gen_testcase() if c.check_correctness and c.num_runs == 0]
    if args.d_qk:
        cases = [c for c in cases if c.d_qk == args.d_qk]
    random.Random(args.seed).shuffle(cases)
    t0, passed, failed = time.time(), 0, []
    for case in cases:
        if time.time() - t0 > args.budget:
            break
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                ok = upstream.test_flash_mla(case.to_test_param()).is_correct
        except Exception as e:  # noqa: BLE001 - an exception is a failing case
            ok, log = False, io.StringIO(f"{log.getvalue()}\n{e!r}")
        if ok:
            passed += 1
        else:
            failed.append((case, log.getvalue()[-800:]))
    ran = passed + len(failed)
    print(f"# {args.impl}: {passed}/{ran} of {len(cases)} cases passed in "
          f"{time.time() - t0:.0f} s (d_qk {args.d_qk or 'both'})")  # fmt: skip
    for case, log in failed[:20]:
        print(f"FAIL {case}\n{log}")
    return 0 if not failed and ran else 1


if __name__ == "__main__":
    sys.exit(main())
