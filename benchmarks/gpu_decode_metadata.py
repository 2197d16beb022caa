"""GPU correctness sweep for decode-metadata expansion (no timing).

Run on a CUDA machine from the repository root:

    PYTHONPATH=src python benchmarks/gpu_decode_metadata.py

Compares the Triton kernels with the PyTorch references on larger random inputs (B up to 512,
n up to 8, W = 2048), checks CUDA-graph replay and the builder's allocation-free path, and
prints one PASS/FAIL line per check. Exit status 1 if anything failed.
"""

from __future__ import annotations

import random
import secrets
import sys

import torch

import sparse_mla
from sparse_mla.ops.decode_metadata import (
    DecodeMetadataBuilder,
    ExpandedDecodeTokens,
    dcp_local_seq_lens,
    expand_decode_tokens,
    native_decode_seq_lens,
)
from sparse_mla.ops.decode_metadata.naive import (
    dcp_local_seq_lens_reference,
    expand_decode_tokens_reference,
    expand_decode_tokens_torch_ops,
    native_decode_seq_lens_reference,
)
from sparse_mla.testing import POISON

DEV = torch.device("cuda")
W = 2048
FAILURES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f"  [{detail}]" if detail and not ok else ""))
    if not ok:
        FAILURES.append(name)


def same(got: ExpandedDecodeTokens, want: ExpandedDecodeTokens) -> tuple[bool, str]:
    for field in ExpandedDecodeTokens._fields:
        g, w = getattr(got, field), getattr(want, field)
        if g.shape != w.shape:
            return False, f"{field} shape {tuple(g.shape)} != {tuple(w.shape)}"
        if not torch.equal(g, w.to(g.device)):
            bad = (g != w.to(g.device)).nonzero()[:3].tolist()
            return False, f"{field} differs at {bad}"
    return True, ""


def poisoned(num_tokens: int, width: int) -> ExpandedDecodeTokens:
    def vec() -> torch.Tensor:
        return torch.full((num_tokens,), POISON, dtype=torch.int32, device=DEV)

    bt = torch.full((num_tokens, width + 64), POISON, dtype=torch.int32, device=DEV)[:, :width]
    return ExpandedDecodeTokens(vec(), bt, vec(), vec())


def block_table(num_reqs: int, layout: str) -> torch.Tensor:
    vals = torch.randint(0, 1 << 24, (num_reqs, W), dtype=torch.int32, device=DEV)
    if layout == "wide_rows":
        big = torch.full((num_reqs, W + 96), POISON, dtype=torch.int32, device=DEV)
        big[:, :W] = vals
        return big[:, :W]
    if layout == "column_step":
        big = torch.full((num_reqs, 2 * W), POISON, dtype=torch.int32, device=DEV)
        big[:, ::2] = vals
        return big[:, ::2]
    return vals


def sweep_expand(rng: random.Random) -> None:
    configs = []
    for num_reqs in (1, 7, 64, 512):
        for max_n in (1, 2, 3, 4, 8):
            for mode in ("uniform", "ragged", "device", "forced_ragged"):
                configs.append((num_reqs, max_n, mode))
    for idx, (num_reqs, max_n, mode) in enumerate(configs):
        if mode == "uniform":
            host = [rng.randint(1, max_n)] * num_reqs
        else:
            host = [rng.randint(0, max_n) for _ in range(num_reqs)]
        seq_lens = torch.tensor(
            [rng.choice([0, 1, rng.randint(0, 9), rng.randint(0, 131072)]) for _ in host],
            dtype=torch.int32,
            device=DEV,
        )
        layout = ("contiguous", "wide_rows", "column_step")[idx % 3]
        bt = block_table(num_reqs, layout)
        dcp_size, interleave = rng.choice([(1, 1), (2, 1), (2, 64), (4, 1), (4, 16), (8, 64)])
        dcp = {
            "dcp_size": dcp_size,
            "dcp_rank": rng.randrange(dcp_size),
            "interleave": interleave,
        }
        total = sum(host)
        num_tokens = total + rng.choice([0, 1, 37])
        kwargs: dict = {"max_decode_len": max_n, "num_tokens": num_tokens, **dcp}
        dl: object = host[0] if mode == "uniform" else host
        if mode == "device":
            dl = torch.tensor(host, dtype=torch.int32, device=DEV)
        if mode == "forced_ragged":
            kwargs["uniform"] = False
        got = expand_decode_tokens(seq_lens, bt, dl, out=poisoned(num_tokens, W), **kwargs)
        want = expand_decode_tokens_torch_ops(seq_lens, bt, host, num_tokens=num_tokens, **dcp)
        ok, why = same(got, want)
        name = f"expand B={num_reqs} n<={max_n} {mode} {layout} dcp={tuple(dcp.values())}"
        if ok and (num_reqs <= 64 or idx % 7 == 0):
            # The loop reference is slow at W=2048: use it on a subset.
            ref = expand_decode_tokens_reference(seq_lens, bt, host, num_tokens=num_tokens, **dcp)
            ok, why = same(got, ref)
            name += " (+loop ref)"
        report(name, ok, why)


def sweep_adversarial(rng: random.Random) -> None:
    for trial in range(6):
        num_reqs = rng.choice([5, 100, 512])
        max_n = 4
        host = [rng.choice([-(2**31), -3, 0, 1, 4, 9, 2**31 - 1]) for _ in range(num_reqs)]
        seq_lens = torch.tensor(
            [rng.choice([-(2**31), -5, 0, 3, 1000, 2**31 - 1]) for _ in host],
            dtype=torch.int32,
            device=DEV,
        )
        bt = block_table(num_reqs, "wide_rows")
        num_tokens = rng.randint(0, num_reqs * max_n)
        got = expand_decode_tokens(
            seq_lens,
            bt,
            torch.tensor(host, dtype=torch.int32, device=DEV),
            max_decode_len=max_n,
            num_tokens=num_tokens,
            out=poisoned(num_tokens, W),
        )
        want = expand_decode_tokens_reference(
            seq_lens, bt, host, max_decode_len=max_n, num_tokens=num_tokens
        )
        ok, why = same(got, want)
        report(f"adversarial device decode_lens trial={trial} B={num_reqs} N={num_tokens}", ok, why)


def sweep_native_and_dcp(rng: random.Random) -> None:
    for num_reqs in (1, 33, 512):
        for next_n in (1, 2, 3, 4, 8):
            seq_lens = torch.randint(-2, 131072, (num_reqs,), dtype=torch.int32, device=DEV)
            dcp_size, interleave = rng.choice([(1, 1), (2, 1), (4, 64)])
            dcp = {
                "dcp_size": dcp_size,
                "dcp_rank": rng.randrange(dcp_size),
                "interleave": interleave,
            }
            out = torch.full((next_n, num_reqs), POISON, dtype=torch.int32, device=DEV).t()
            got = native_decode_seq_lens(seq_lens, next_n=next_n, out=out, **dcp)
            want = native_decode_seq_lens_reference(seq_lens, next_n=next_n, **dcp)
            report(
                f"native B={num_reqs} n={next_n} dcp={tuple(dcp.values())}", torch.equal(got, want)
            )
    for dcp_size, interleave in ((2, 1), (2, 64), (4, 1), (4, 16), (8, 64)):
        seq_lens = torch.randint(-5, 1 << 20, (5000,), dtype=torch.int32, device=DEV)
        ok = True
        total = torch.zeros_like(seq_lens)
        for rank in range(dcp_size):
            got = dcp_local_seq_lens(
                seq_lens, dcp_size=dcp_size, dcp_rank=rank, interleave=interleave
            )
            want = dcp_local_seq_lens_reference(
                seq_lens, dcp_size=dcp_size, dcp_rank=rank, interleave=interleave
            )
            ok &= torch.equal(got, want)
            total += got
        ok &= torch.equal(total, seq_lens.clamp_min(0))
        report(f"dcp_local_seq_lens W={dcp_size} I={interleave}", bool(ok))


def check_cuda_graph(rng: random.Random) -> None:
    """Capture one ragged expansion with device decode_lens, replay on new data."""
    num_reqs, max_n, num_tokens = 256, 4, 256 * 4
    seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=DEV)
    dl = torch.zeros(num_reqs, dtype=torch.int32, device=DEV)
    bt = torch.zeros(num_reqs, W, dtype=torch.int32, device=DEV)
    out = poisoned(num_tokens, W)
    kwargs = {
        "max_decode_len": max_n,
        "num_tokens": num_tokens,
        "out": out,
        "dcp_size": 2,
        "dcp_rank": 1,
        "interleave": 64,
    }
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        expand_decode_tokens(seq_lens, bt, dl, **kwargs)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand_decode_tokens(seq_lens, bt, dl, **kwargs)
    ok = True
    for _ in range(3):
        host = [rng.randint(0, max_n) for _ in range(num_reqs)]
        seq_lens.copy_(torch.randint(0, 100000, (num_reqs,), dtype=torch.int32))
        dl.copy_(torch.tensor(host, dtype=torch.int32))
        bt.copy_(torch.randint(0, 1 << 24, (num_reqs, W), dtype=torch.int32))
        out.seq_lens.fill_(POISON)
        graph.replay()
        want = expand_decode_tokens_torch_ops(
            seq_lens, bt, host, num_tokens=num_tokens, dcp_size=2, dcp_rank=1, interleave=64
        )
        ok &= same(out, want)[0]
    report("CUDA graph replay of ragged expand (device decode_lens)", bool(ok))


def check_builder(rng: random.Random) -> None:
    builder = DecodeMetadataBuilder(
        4096, 512, W, 8, native_decode_lens=(1, 2), dcp_size=2, dcp_rank=0, interleave=64
    )
    seq_lens = torch.randint(0, 131072, (512,), dtype=torch.int32, device=DEV)
    bt = block_table(512, "contiguous")
    cases = {
        "native": [2] * 512,
        "uniform": [4] * 512,
        "ragged": [rng.randint(0, 8) for _ in range(512)],
    }
    dcp = {"dcp_size": 2, "dcp_rank": 0, "interleave": 64}
    for name, host in cases.items():
        for dl in (host, torch.tensor(host, dtype=torch.int32)):
            builder.build(seq_lens, bt, dl, num_tokens=4096)  # warm up: compile
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        m = builder.build(seq_lens, bt, torch.tensor(host, dtype=torch.int32), num_tokens=4096)
        ptr = m.seq_lens.data_ptr()
        for _ in range(3):
            m = builder.build(seq_lens, bt, host, num_tokens=4096)
        torch.cuda.synchronize()
        ok = torch.cuda.memory_allocated() == before and m.seq_lens.data_ptr() == ptr
        if m.flattened:
            want = expand_decode_tokens_torch_ops(seq_lens, bt, host, num_tokens=4096, **dcp)
            got = ExpandedDecodeTokens(m.seq_lens, m.block_table, m.decode_lens, m.req_id)
            ok &= same(got, want)[0] and m.requires_padding == (name == "ragged")
        else:
            want = native_decode_seq_lens_reference(seq_lens, next_n=2, **dcp)
            ok &= torch.equal(m.seq_lens, want) and m.next_n == 2
        report(f"builder {name}: results, stable views, no device allocation", bool(ok))


def main() -> int:
    print(sparse_mla.info())
    if sparse_mla.mode() != "cuda":
        print("FAIL needs a CUDA device (running in interpreter mode)")
        return 1
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sweep_expand(rng)
    sweep_adversarial(rng)
    sweep_native_and_dcp(rng)
    check_cuda_graph(rng)
    check_builder(rng)
    print(f"{'ALL PASS' if not FAILURES else f'{len(FAILURES)} FAILED'} (seed={seed})")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
