"""Every public kernel wrapper rejects host tensors with a clear message when kernels run on
the GPU (simulated here by turning the interpreter flag off; nothing is launched)."""

from __future__ import annotations

import pytest
import torch

import sparse_mla
from sparse_mla import _runtime
from sparse_mla._launch import clear_host_plans

I32 = dict(dtype=torch.int32)


def calls() -> dict[str, object]:
    bt = torch.arange(8, **I32).view(2, 4)
    idx = torch.randint(-1, 64, (3, 128), **I32)
    req = torch.tensor([0, 1, 0], **I32)
    k_cache = sparse_mla.new_indexer_k_cache(4, 16, 32, fp8=False, device="cpu")
    mla = sparse_mla.new_mla_cache(4, 16, fp8=False, device="cpu")
    return {
        "remap": lambda: sparse_mla.convert_req_index_to_global_index(req, bt, idx, block_size=16),
        "dcp": lambda: sparse_mla.filter_and_convert_dcp_index(
            req, bt, idx, dcp_size=2, dcp_rank=0, block_size=16
        ),
        "expand": lambda: sparse_mla.expand_decode_tokens(
            torch.tensor([5, 9], **I32), bt, 2, max_decode_len=2
        ),
        "logits": lambda: sparse_mla.index_logits(
            torch.randn(2, 4, 32).bfloat16(),
            torch.randn(2, 4),
            k_cache,
            torch.tensor([20, 30], **I32),
            bt,
        ),
        "topk": lambda: sparse_mla.select_topk(
            torch.randn(2, 300), torch.tensor([300, 200], **I32), k=128
        ),
        "write_indexer_k": lambda: sparse_mla.write_indexer_k(
            torch.randn(2, 32).bfloat16(), k_cache, torch.tensor([0, 5], **I32)
        ),
        "write_mla_latent": lambda: sparse_mla.write_mla_latent(
            torch.randn(2, 512).bfloat16(),
            torch.randn(2, 64).bfloat16(),
            mla,
            torch.tensor([0, 5], **I32),
        ),
    }


@pytest.mark.parametrize("name", list(calls()))
def test_host_tensors_rejected_when_kernels_run_on_the_gpu(name, monkeypatch):
    call = calls()[name]
    monkeypatch.setattr(_runtime, "INTERPRETER", False)
    clear_host_plans()  # verdicts cached under the interpreter flag
    with pytest.raises(ValueError, match="is on cpu, but the kernels run on the GPU"):
        call()


@pytest.mark.skipif(not _runtime.INTERPRETER, reason="CPU kernels need the interpreter")
@pytest.mark.parametrize("name", ["remap", "topk"])
def test_same_calls_run_under_the_interpreter(name):
    calls()[name]()  # the inputs above are valid: only the device check stops them
