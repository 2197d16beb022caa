"""``sparse-mla demo``: the main job.

Runs the quick verification sweep, then a worked example of each kernel that prints its
inputs and outputs beside the plain PyTorch reference.
"""

from __future__ import annotations

import argparse

import torch

from ._runtime import default_device, info
from .ops.decode_metadata import dcp_local_seq_lens, expand_decode_tokens
from .ops.remap import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .ops.remap.naive import convert_req_index_to_global_index_reference


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
    exp = expand_decode_tokens(
        seq_lens, block_table, [3, 1, 4, 0], max_decode_len=4, num_tokens=10
    )
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sparse-mla demo", description=__doc__)
    ap.add_argument("--skip-verify", action="store_true", help="only the worked examples")
    args = ap.parse_args(argv)
    print(" ".join(f"{k}={v}" for k, v in info().items()))
    rc = 0
    if not args.skip_verify:
        from .verify import main as verify_main

        print("\n== quick verification sweep ==")
        rc = verify_main(["--quick"])
    print("\n== worked examples ==")
    if not worked_examples():
        rc = 1
    print("\ndemo:", "PASS" if rc == 0 else "FAIL")
    return rc
