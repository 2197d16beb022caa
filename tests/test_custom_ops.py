"""torch.ops.sparse_mla: opcheck of every op, the ops equal to the public functions, and a
whole decode step under torch.compile(fullgraph=True) equal to eager."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sparse_mla import (
    AttentionConfig,
    TopKConfig,
    attention_workspace,
    library,
    topk_workspace,
)
from sparse_mla.dcp import global_topk_workspace, local_topk_candidates
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.decode.cases import clone_inputs, random_step
from sparse_mla.ops.decode_metadata import DecodeMetadataBuilder
from sparse_mla.testing import poison

I32 = torch.int32
K = 16
HEADS = 4


@pytest.fixture(scope="module")
def step():
    """One tiny decode step (2 requests, bf16 caches), shared by the op cases."""
    return random_step(random.Random(1), seq_lens=[90, 70], decode_lens=[1, 1], num_heads=HEADS)


def _i32(*shape, lo=-1, hi=100):
    return torch.randint(lo, hi, shape, dtype=I32)


def _cases(step) -> dict[str, tuple]:
    """Positional arguments of each op (schema order), tiny shapes."""
    x = step.inputs
    b, w = x.block_table.shape
    bt, lens = x.block_table, x.seq_lens
    req = torch.arange(b, dtype=I32)
    idx = torch.stack([torch.randperm(int(n))[:K].sort().values for n in lens]).to(I32)
    slots = library.convert_req_index_to_global_index(req, bt, idx)
    logits = torch.randn(b, 128)
    ws = global_topk_workspace(b, k=K, dcp_size=2)
    cands = torch.stack(
        [
            local_topk_candidates(
                logits, lens // 2, k=K, dcp_size=2, dcp_rank=r, interleave=1, workspace=ws
            ).clone()
            for r in range(2)
        ]
    )
    attn_ws = attention_workspace(b, HEADS, K, cache_format="bf16", config=AttentionConfig(num_splits=2, block_n=16))

    def out(*shape, dtype=I32):
        return torch.empty(shape, dtype=dtype)

    gws = library._gtopk_tensors(global_topk_workspace(b, k=K, dcp_size=2))
    return {
        "expand_decode_tokens": (
            lens, bt, out(3), out(3, w), out(3), out(3), [1, 2], None, None, 2, None, 1, 0, 1,
            None, None,
        ),
        "native_decode_seq_lens": (lens, out(b, 2), 2, 2, 1, 1, None, None),
        "dcp_local_seq_lens": (lens, out(b), 2, 1, 1, library._encode(library._expand.ExpandConfig(), "expand"), None),
        "write_indexer_k": (x.k_idx, x.index_k_cache.clone(), x.slot_mapping),
        "write_mla_latent": (x.kv[:, :512], x.kv[:, 512:], x.kv_cache.clone(), x.slot_mapping),
        "index_logits": (x.q_idx, x.idx_weights, x.index_k_cache, lens, bt, out(b, 128, dtype=torch.float32), None, None),
        "select_topk": (
            logits, lens, out(b, K), out(b), bt, req, topk_workspace(b), K, 64, None, None,
            None, library._encode(TopKConfig(), "topk"), None,
        ),
        "convert_req_index_to_global_index": (
            req, bt, idx, out(b, K), out(b), None, None, 64, None, "auto", None,
        ),
        "filter_and_convert_dcp_index": (
            req, bt, idx, out(b, K), out(b), 2, 1, 1, 64, None, True, "auto", None,
        ),
        "sparse_mla_decode": (
            x.q, x.kv_cache, slots, out(b, HEADS, 512, dtype=torch.bfloat16),
            out(b, HEADS, dtype=torch.float32), None, None, None, None, attn_ws.partial_out,
            attn_ws.partial_lse, 0.135, None,
            library._encode(AttentionConfig(num_splits=2, block_n=16), "attention"),
        ),
        "local_topk_candidates": (logits, lens // 2, gws, None, b, K, 2, 1, 1),
        "merge_topk_candidates": (cands, out(b, K), gws, b, K),
        "rescale_partial": (
            torch.randn(b, HEADS, 32), torch.randn(2, b, HEADS), out(b, HEADS, 32, dtype=torch.float32),
            out(b, HEADS, dtype=torch.float32), 1, "all_reduce",
        ),
    }  # fmt: skip


def test_every_op_has_a_case(step):
    assert sorted(_cases(step)) == sorted(library.OPS)
    for name in library.OPS:
        assert hasattr(torch.ops.sparse_mla, name)


@pytest.mark.parametrize("name", library.OPS)
def test_opcheck(step, name):
    args = _cases(step)[name]
    torch.library.opcheck(getattr(torch.ops.sparse_mla, name), args)
