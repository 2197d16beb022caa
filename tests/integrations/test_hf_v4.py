"""transformers' DeepSeek-V4 through sparse-mla against HF's own implementation.

Tiny random models (``hf.v4.tiny_config``: the real 448 + 64 row and 128-wide indexer, two
heads, a sliding, a CSA (rate 4, index_topk 3) and an HCA (rate 8) layer, window 8) and
prompts of 10-24 tokens: past the window, with more compressed entries than the top-k keeps,
so the window edge, the selection and every compressed entry decide what a row attends.

Tolerances are the kit's (``sparse_mla.testing.generation``): logits within ``1.5 x``
HF-bf16's error ``+ 0.05`` of an fp32 forward (fp8 caches ``8 x + 0.1``), a differing greedy
token only where HF's own logits nearly tie (``FLIP_GAP``). Our caches hold bf16 (or e4m3)
rows where HF's fp32 model keeps fp32 ones, hence the budget of a bf16 model.

With index_topk 3, one entry selected differently at a near-tie of the indexer's scores
(rows apart by bf16 rounding: observed 0.006 of 1.4) moves a row's logits by up to 0.8, far
beyond any rounding budget: the selection is checked on its own and the logits against HF's
forwards made to attend our selection (``_v4_checks``).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")
# The model stays on the CPU here (the interpreter runs the kernels); the GPU run is
# test_hf_v4_gpu.py.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-interpreter test: the model is not moved to CUDA"
)

from sparse_mla.integrations import hf  # noqa: E402
from sparse_mla.integrations.hf import v4  # noqa: E402
from sparse_mla.testing.generation import v4_forced_forward, v4_recorded_selection  # noqa: E402

from ._v4_checks import logits_ok, selection_ok, streams_ok  # noqa: E402

PROMPT, NEW = 24, 10
GREEDY = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}


@pytest.fixture(scope="module")
def bf16_run():
    """One greedy generation of NEW tokens from a PROMPT-token prompt, ours and HF's."""
    model = v4.random_model(dtype=torch.bfloat16, seed=3)
    model.generation_config.eos_token_id = None
    torch.manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT))
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=NEW, **GREEDY)
        fast = hf.enable(copy.deepcopy(model), record_topk=True)
        ours = fast.generate(prompt, max_new_tokens=NEW, **GREEDY)
    return model, fast, prompt, theirs, ours


def test_greedy_generation_matches_hf(bf16_run):
    model, fast, _, theirs, ours = bf16_run
    assert isinstance(fast.sparse_mla, v4.SparseMlaV4State)
    assert ours.sequences.shape == (1, PROMPT + NEW)
    streams_ok(model, ours.sequences, theirs.sequences, PROMPT)


def test_teacher_forced_logits_within_tolerance(bf16_run):
    """Our generation's logits (the prefill's last row, then each decode step) against HF's
    bf16 and fp32 forwards on our tokens, attending our selection."""
    model, fast, _, _, ours = bf16_run
    seq = ours.sequences[:, :-1]  # the tokens fed: our selection covers each of them
    sel = v4_recorded_selection(fast)
    hf_bf16 = v4_forced_forward(model, seq, sel)[0][0, PROMPT - 1 :]
    exact = v4_forced_forward(copy.deepcopy(model).float(), seq, sel)[0][0, PROMPT - 1 :]
    got = torch.cat([x.float() for x in ours.logits])
    logits_ok(got, hf_bf16, exact, "bf16 generation")


def test_csa_selection_matches_hf_indexer(bf16_run):
    """Every position's CSA top-k set (prefill rows and decode steps) against HF's fp32
    indexer on our tokens: equal but at near-ties (the inputs differ by the rounding of the
    sliding layer below and of the compressed keys)."""
    model, fast, _, _, ours = bf16_run
    assert set(fast.sparse_mla.topk) == {1} and len(fast.sparse_mla.topk[1]) == NEW
    sel = v4_recorded_selection(fast)[1][0]  # one prefill + NEW - 1 decode steps
    _, seen = v4_forced_forward(copy.deepcopy(model).float(), ours.sequences[:, :-1])
    picks, scores = seen[1][0][0], seen[1][1][0]
    prefill = selection_ok(sel, picks, scores, range(PROMPT))
    decode = selection_ok(sel, picks, scores, range(PROMPT, PROMPT + NEW - 1))
    print(f"CSA layer: {prefill}/{PROMPT} prefill and {decode}/{NEW - 1} decode rows select "
          "HF's entries")  # fmt: skip
    assert prefill + decode >= PROMPT + NEW - 3  # near-ties are rare
    assert (sel[-1] >= 0).sum() == 3  # past 4 * 3 tokens the top-k is full


def test_fp32_model_enable_twice_and_disable():
    """An fp32 model (the rings take fp32 rows; the rows are rounded to bf16 where stored):
    HF's fp32 forward back bit for bit after disable; enabling twice routes once."""
    model = v4.random_model(dtype=torch.float32, seed=5)
    torch.manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (1, 13))
    with torch.no_grad():
        exact = model(ids, use_cache=False).logits
        hf_bf16 = copy.deepcopy(model).bfloat16()(ids, use_cache=False).logits.float()
        hf.enable(model, block_size=4)
        got = model(ids, use_cache=False).logits
        hf.enable(model, block_size=4)
        again = model(ids, use_cache=False).logits
        hf.disable(model)
        back = model(ids, use_cache=False).logits
    assert got.dtype == torch.float32
    assert torch.equal(again, got)
    assert torch.equal(back, exact) and not hasattr(model, "sparse_mla")
    logits_ok(got, hf_bf16, exact, "fp32 model")


def test_fp8_caches_within_tolerance():
    """MODEL1 fp8 window and compressed caches, the fp8 indexer cache and queries (HF's
    forwards attend our selection; e4m3's coarser scores tie more often)."""
    model = v4.random_model(dtype=torch.bfloat16, seed=7)
    torch.manual_seed(8)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    fast = hf.enable(copy.deepcopy(model), fp8=True, record_topk=True)
    with torch.no_grad():
        got = fast(ids, use_cache=False).logits
    sel = v4_recorded_selection(fast)
    hf_bf16 = v4_forced_forward(model, ids, sel)[0]
    exact = v4_forced_forward(copy.deepcopy(model).float(), ids, sel)[0]
    # e4m3 keeps 3 mantissa bits to bf16's 7: allow 8x HF-bf16's error.
    logits_ok(got, hf_bf16, exact, "fp8 caches", scale=8, slack=0.1)


def test_chunked_prefill_equals_one_step():
    """A prompt taken in chunks of 4 (steps of n = 4, 4, 2 rows a request: the window ring,
    compressor rings and compressed entries carried across) gives the logits of one step."""
    model = v4.random_model(dtype=torch.bfloat16, seed=13)
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    with torch.no_grad():
        whole = hf.enable(copy.deepcopy(model))(ids, use_cache=False).logits
        chunked = hf.enable(copy.deepcopy(model), prefill_chunk=4)(ids, use_cache=False).logits
    torch.testing.assert_close(chunked, whole, atol=0.0, rtol=0.0)


def test_a_batch_of_two_generates_like_hf():
    """Two requests of one length share every step (a block-table row each, pages of 4,
    prefill in chunks of 4)."""
    model = v4.random_model(dtype=torch.bfloat16, seed=11)
    model.generation_config.eos_token_id = None
    torch.manual_seed(12)
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=3, **GREEDY)
        fast = hf.enable(copy.deepcopy(model), block_size=4, prefill_chunk=4)
        ours = fast.generate(ids, max_new_tokens=3, **GREEDY)
    assert fast.sparse_mla.batch == 2 and len(fast.sparse_mla.pools["csa"].pages) == 2
    streams_ok(model, ours.sequences, theirs.sequences, ids.shape[1])
    first = ours.logits[0].float() - theirs.logits[0].float()  # the prefill's last rows
    assert first.abs().max() <= 0.05 * theirs.logits[0].float().abs().max()


def _beam_gaps(model, ids, teacher) -> torch.Tensor:
    """|beam score - the beam's teacher-forced log-probability under ``teacher``| of each
    returned beam (length_penalty 0: a beam's score is its tokens' log-probabilities)."""
    kw = {"num_beams": 3, "num_return_sequences": 3, "max_new_tokens": 3, "do_sample": False,
          "length_penalty": 0.0, "return_dict_in_generate": True,
          "output_scores": True}  # fmt: skip
    with torch.no_grad():
        out = model.generate(ids, **kw)
        logp = teacher(out.sequences, use_cache=False).logits.float().log_softmax(-1)
    p = ids.shape[1]
    tf = logp[:, p - 1 : -1].gather(-1, out.sequences[:, p:, None]).squeeze(-1).sum(-1)
    return (out.sequences_scores - tf).abs()


def test_beam_search_scores_match_teacher_forcing():
    """Beam search reorders the caches each step (HF's Cache.reorder_cache): a beam must then
    continue from its own window pages, compressed pages and compressor rings, so its score
    equals HF's teacher-forced log-probability of its tokens. (Without the reorder this
    seed's beams are off by 0.06 to 0.43; with it by at most 5e-3, bf16 rows against HF's
    fp32.)"""
    model = v4.random_model(seed=5)
    model.generation_config.eos_token_id = None
    torch.manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    hf_gap = _beam_gaps(model, ids, model)
    gap = _beam_gaps(hf.enable(copy.deepcopy(model)), ids, model)
    print(f"beam score vs HF teacher-forced: ours {gap.tolist()}, HF {hf_gap.tolist()}")
    assert hf_gap.max() < 1e-3
    assert gap.max() < 2e-2


def test_a_padded_batch_is_refused():
    model = v4.random_model()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    fast = hf.enable(model)
    with pytest.raises(ValueError, match="without padding"), torch.no_grad():
        fast.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"head_dim": 256, "partial_rotary_factor": 0.25}, "head_dim == 512"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor == 64"),
        ({"index_head_dim": 64}, "index_head_dim"),
        ({"index_topk": 20000}, "index_topk"),
    ],
)
def test_enable_rejects_sizes_the_kernels_do_not_take(overrides, match):
    model = v4.random_model(v4.tiny_config(**overrides))
    with pytest.raises(ValueError, match=match):
        hf.enable(model)
    assert not hasattr(model, "sparse_mla")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prefill_chunk": 0}, ValueError, "prefill_chunk"),
        ({"prefill_chunk": 65536}, ValueError, "prefill_chunk"),
        ({"block_size": 2.0}, TypeError, "block_size"),
        ({"fp8": 1}, TypeError, "fp8"),
        ({"attention": "torch"}, TypeError, "attention"),
    ],
)
def test_enable_rejects_bad_arguments(kwargs, error, match):
    model = v4.random_model()
    with pytest.raises(error, match=match):
        hf.enable(model, **kwargs)
    assert not hasattr(model, "sparse_mla")


def test_enable_names_what_a_differing_transformers_lacks(monkeypatch):
    """A release whose DeepSeek-V4 differs from the one the integration was written for is
    refused at enable(), naming the missing part, and nothing is patched."""
    import transformers
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    model = v4.random_model()
    csa = model.model.layers[1].self_attn
    forwards = {id(x): x.forward for x in model.modules()}

    def refused(error: type, match: str) -> None:
        with pytest.raises(error, match=match):
            hf.enable(model)
        assert not hasattr(model, "sparse_mla")
        assert all(x.forward == forwards[id(x)] for x in model.modules())
        monkeypatch.undo()

    monkeypatch.delattr(m, "apply_rotary_pos_emb")  # a helper renamed
    refused(RuntimeError, r"DeepseekV4 lacks .*apply_rotary_pos_emb")
    monkeypatch.delattr(csa.compressor.indexer.scorer, "softmax_scale")  # an attribute renamed
    refused(RuntimeError, r"DeepseekV4Attention differs .* no compressor\.indexer\.scorer\.")
    monkeypatch.delattr(model.model.layers[2].self_attn.compressor, "gate_proj")
    refused(RuntimeError, r"no compressor\.gate_proj")
    monkeypatch.setattr(csa, "layer_type", "global_attention")  # a new layer kind
    refused(ValueError, r"layer 1 has layer_type 'global_attention'")
    monkeypatch.setitem(sys.modules, "transformers.models.deepseek_v4", None)  # no such model
    refused(RuntimeError, rf"transformers {transformers.__version__} has no DeepseekV4")


def test_enable_rejects_a_model_that_is_neither():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(TypeError, match=r"DeepSeek-V3\.2 \(DSA\) or DeepSeek-V4 .*Llama"):
        hf.enable(LlamaForCausalLM(cfg))
    with pytest.raises(TypeError, match="DeepseekV4Attention"):
        v4.enable(LlamaForCausalLM(cfg))
