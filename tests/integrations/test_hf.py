"""transformers' DeepSeek-V3.2 through sparse-mla against HF's own dense implementation.

Tiny random models with the real latent (512 + 64) and indexer (64 x 128) sizes and
index_topk = 128 below the context (prompts of 136-160 tokens, 176 after generation), so
the selection decides what each row attends.

Tolerance of the logits (the kit's ``sparse_mla.testing.generation``): the kernels take
bf16 queries and latents and run their softmax in fp32, HF's bf16 model rounds at every op.
Neither is exact, so both are measured against an fp32 forward of the same weights on the
same tokens: our largest and our mean absolute error may each be at most ``1.5 x`` HF-bf16's
own ``+ 0.05`` (fp8 caches: ``8 x + 0.1``). A greedy token that differs from HF's must be a
near-tie: HF's logit gap at that step at most ``FLIP_GAP``.
"""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch

pytest.importorskip("transformers")
# The model stays on the CPU here (the interpreter runs the kernels); on a CUDA machine it
# would have to move to the GPU first, which these tests do not do yet.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-interpreter test: the model is not moved to CUDA"
)

from sparse_mla.integrations import hf  # noqa: E402
from sparse_mla.integrations.hf._common import has_path  # noqa: E402
from sparse_mla.testing.generation import (  # noqa: E402
    FLIP_GAP,
    first_difference,
    fp32_logits,
    generation_logits_error,
)

PROMPT, NEW = 144, 32


def _hf_topk(model, ids) -> dict[int, torch.Tensor]:
    """HF's own indexer selection per layer ([B, S, k] positions) for a forward on ids."""
    got: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.indexer.register_forward_hook(
            lambda mod, args, out: got.__setitem__(mod.layer_idx, out)
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return got


def _overlap(ours: torch.Tensor, theirs: torch.Tensor, first_pos: int) -> tuple[int, list[float]]:
    """Rows whose sets are equal, and each row's overlap; HF's entries past the row's own
    position (its -inf / masked picks when fewer than k are visible) are dropped."""
    equal, frac = 0, []
    for r in range(ours.shape[0]):
        pos = first_pos + r
        a = set(ours[r][ours[r] >= 0].tolist())
        b = {p for p in theirs[r].tolist() if p <= pos}
        equal += a == b
        frac.append(len(a & b) / max(len(b), 1))
    return equal, frac


def _errors(got: torch.Tensor, hf_low: torch.Tensor, exact: torch.Tensor, what: str, scale=1.5,
            slack=0.05) -> None:  # fmt: skip
    """Assert ours is within ``scale x HF's low-precision error + slack`` of the fp32 logits,
    in the largest and in the mean absolute error (the kit's rule)."""
    err, summary = generation_logits_error(got, hf_low, exact, scale=scale, slack=slack)
    print(f"{what} {summary}")
    assert err is None, err


@pytest.fixture(scope="module")
def bf16_run():
    """One greedy generation of NEW tokens from a PROMPT-token prompt, ours and HF's."""
    model = hf.random_model(dtype=torch.bfloat16, seed=3)
    model.generation_config.eos_token_id = None
    torch.manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT))
    kw = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True}
    with torch.no_grad():
        theirs = model.generate(prompt, **kw).sequences
    fast = hf.enable(copy.deepcopy(model), record_topk=True)
    with torch.no_grad():
        ours = fast.generate(prompt, output_logits=True, **kw)
    return model, fast, prompt, theirs, ours


def test_bf16_greedy_generation_matches_hf(bf16_run):
    model, _, prompt, theirs, ours = bf16_run
    seq = ours.sequences
    assert seq.shape == theirs.shape == (1, PROMPT + NEW)
    diff = first_difference(model, seq, theirs, PROMPT)  # allowed only at HF's near-ties
    if diff is not None:
        step, gap = diff
        assert gap <= FLIP_GAP, f"token {step} differs with HF's logit gap {gap:.3f}"


def test_bf16_teacher_forced_logits_within_tolerance(bf16_run):
    model, _, _, _, ours = bf16_run
    seq = ours.sequences
    with torch.no_grad():
        hf_bf16 = model(seq, use_cache=False).logits.float()[0, PROMPT - 1 : -1]
    exact = fp32_logits(model, seq)[0, PROMPT - 1 : -1]
    got = torch.cat([x.float() for x in ours.logits])  # [NEW, vocab], decode rows but the first
    _errors(got, hf_bf16, exact, "bf16")


def test_bf16_topk_sets_equal_hf(bf16_run):
    model, fast, prompt, _, _ = bf16_run
    hf_sel = _hf_topk(model, prompt)
    for layer, calls in fast.sparse_mla.topk.items():
        ours = calls[0][0]  # the prefill: every prompt token a row with its own top-k
        equal, frac = _overlap(ours, hf_sel[layer][0], 0)
        print(f"layer {layer}: {equal}/{PROMPT} rows equal, min overlap {min(frac):.4f}")
        if layer == 0:  # the same inputs bit for bit: the same sets
            assert equal == PROMPT
        else:  # inputs differ by the layers below's rounding: near-ties may swap
            assert min(frac) >= 0.95 and sum(frac) / len(frac) >= 0.99
    assert len(fast.sparse_mla.topk[0]) == NEW  # one prefill + NEW - 1 decode steps recorded


def test_fp32_teacher_forced_logits_within_tolerance():
    """fp32 model: the kernels see bf16 queries / latents, so the error budget is bf16's."""
    model = hf.random_model(dtype=torch.float32, seed=5)
    torch.manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (1, 136))
    with torch.no_grad():
        exact = model(ids, use_cache=False).logits
        hf_bf16 = copy.deepcopy(model).bfloat16()(ids, use_cache=False).logits.float()
        # The torch attention keeps it cheap in the interpreter; the casts around the kernels
        # are the same whichever attention runs (the bf16 tests run the library's).
        fast = hf.enable(copy.deepcopy(model), attention="torch")
        got = fast(ids, use_cache=False).logits
    assert got.dtype == torch.float32
    _errors(got, hf_bf16, exact, "fp32 model")


def test_fp8_caches_overlap_with_hf():
    """fp8 indexer keys / queries and fp8 latents: report the top-k overlap with HF's
    (one layer: its inputs are HF's, so the overlap measures the fp8 rounding alone)."""
    model = hf.random_model(hf.tiny_config(num_hidden_layers=1), dtype=torch.bfloat16, seed=7)
    torch.manual_seed(8)
    ids = torch.randint(0, model.config.vocab_size, (1, 160))
    hf_sel = _hf_topk(model, ids)
    # The torch attention keeps this test cheap in the interpreter (tests/decode runs the
    # library's attention on fp8 caches).
    fast = hf.enable(copy.deepcopy(model), fp8=True, record_topk=True, attention="torch")
    with torch.no_grad():
        got = fast(ids, use_cache=False).logits.float()
        hf_bf16 = model(ids, use_cache=False).logits.float()
    exact = fp32_logits(model, ids)
    equal, frac = _overlap(fast.sparse_mla.topk[0][0][0], hf_sel[0][0], 0)
    mean = sum(frac[128:]) / len(frac[128:])  # rows where k < visible
    print(f"fp8: {equal}/160 rows equal, mean overlap where k < visible {mean:.4f}")
    assert mean >= 0.95
    # e4m3 keeps 3 mantissa bits to bf16's 7: allow 8x HF-bf16's error.
    _errors(got, hf_bf16, exact, "fp8 caches", scale=8, slack=0.1)


def test_enable_rejects_sizes_the_kernels_do_not_take():
    for bad, match in [
        ({"kv_lora_rank": 256}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 32}, "qk_rope_head_dim"),
        ({"index_topk": 20000}, "index_topk"),
    ]:
        model = hf.random_model(hf.tiny_config(num_hidden_layers=1, **bad))
        with pytest.raises(ValueError, match=match):
            hf.enable(model)


def test_enable_and_disable_route_the_attention():
    """Other head counts / head dims (absorption), and HF's own forward back after disable."""
    cfg = hf.tiny_config(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         qk_nope_head_dim=48, v_head_dim=16, hidden_size=192)  # fmt: skip
    model = hf.random_model(cfg, seed=9)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        hf.enable(model)
        got = model(ids, use_cache=False).logits
        assert model.sparse_mla.plan is not None
        hf.disable(model)
        back = model(ids, use_cache=False).logits
    assert torch.equal(back, ref)
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert not hasattr(model, "sparse_mla")


def test_a_batch_of_two_generates_like_hf():
    """Two requests of equal length share the step (one block-table row each)."""
    model = hf.random_model(hf.tiny_config(num_hidden_layers=1), seed=11)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    kw = {"max_new_tokens": 3, "do_sample": False}
    with torch.no_grad():
        theirs = model.generate(ids, **kw)
        fast = hf.enable(copy.deepcopy(model))
        ours = fast.generate(ids, **kw)
    assert torch.equal(ours, theirs)
    assert len(fast.sparse_mla.pages) == 2


def test_chunked_prefill_equals_one_step():
    """A prompt taken in chunks of 5 (MTP-style steps of n = 5, then the rest) gives the
    logits of one 13-row step: same selection, same caches."""
    model = hf.random_model(hf.tiny_config(num_hidden_layers=1), dtype=torch.bfloat16, seed=13)
    ids = torch.randint(0, model.config.vocab_size, (1, 13))
    with torch.no_grad():
        whole = hf.enable(copy.deepcopy(model))(ids, use_cache=False).logits
        chunked = hf.enable(copy.deepcopy(model), prefill_chunk=5)(ids, use_cache=False).logits
    torch.testing.assert_close(chunked, whole, atol=0.0, rtol=0.0)


def _beam_gaps(model, ids) -> torch.Tensor:
    """|beam score - the beam's own teacher-forced log-probability| of each returned beam
    (length_penalty 0: a beam's score is the sum of its tokens' log-probabilities)."""
    kw = {"num_beams": 3, "num_return_sequences": 3, "max_new_tokens": 5, "do_sample": False,
          "length_penalty": 0.0, "return_dict_in_generate": True,
          "output_scores": True}  # fmt: skip
    with torch.no_grad():
        out = model.generate(ids, **kw)
        seq = out.sequences
        logp = model(seq, use_cache=False).logits.float().log_softmax(-1)
    p = ids.shape[1]
    tf = logp[:, p - 1 : -1].gather(-1, seq[:, p:, None]).squeeze(-1).sum(-1)
    return (out.sequences_scores - tf).abs()


def test_beam_search_scores_match_teacher_forcing():
    """Beam search reorders the caches each step (HF's Cache.reorder_cache): every beam
    must then continue from its own history, so its score equals the teacher-forced
    log-probability of its tokens (the paged caches' rows are gathered per beam)."""
    model = hf.random_model(hf.tiny_config(num_hidden_layers=1), seed=17)
    model.generation_config.eos_token_id = None
    torch.manual_seed(18)
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    hf_gap = _beam_gaps(model, ids)
    gap = _beam_gaps(hf.enable(copy.deepcopy(model), attention="torch"), ids)
    print(f"beam score vs teacher-forced: ours {gap.tolist()}, HF {hf_gap.tolist()}")
    assert hf_gap.max() < 1e-3
    # Prefill and decode rows round the same kernels' inputs alike (bf16 queries / latents).
    assert gap.max() < 1e-2


def _left_padded(model, pad: int = 3):
    """Two prompts of 13 and 13 - pad tokens, the shorter left-padded, with their mask."""
    torch.manual_seed(20)
    ids = torch.randint(1, model.config.vocab_size, (2, 13))
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


@pytest.mark.parametrize("impl", ["eager", "sdpa"])  # float (additive) and bool 4-D masks
def test_left_padded_batch_generates_like_hf(impl):
    """A padded row attends only its own tokens (the mask's zeros never enter its caches):
    its logits match HF's on the same padded batch, prefill and decode, and its own run
    without the padding."""
    cfg = hf.tiny_config(num_hidden_layers=1)
    model = hf.random_model(cfg, seed=19, attn_implementation=impl)
    model.generation_config.eos_token_id = None
    ids, mask = _left_padded(model)
    kw = {"max_new_tokens": 3, "do_sample": False, "output_logits": True,
          "return_dict_in_generate": True}  # fmt: skip
    fast = hf.enable(copy.deepcopy(model), attention="torch")
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=mask, **kw)
        ours = fast.generate(ids, attention_mask=mask, **kw)
        alone = fast.generate(ids[:1, 3:], **kw)
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        got = fast(ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(ours.sequences, theirs.sequences)
    real = mask.bool()  # logits at padding positions mean nothing
    steps = torch.stack(ours.logits) - torch.stack(theirs.logits)
    for err in ((got - ref)[real], steps):
        print(f"padded batch: max |ours - HF| {err.abs().max():.4f}")
        assert err.abs().max() <= 0.05 * ref[real].abs().max()
    own = (torch.stack(ours.logits)[:, 0] - torch.stack(alone.logits)[:, 0]).abs().max()
    print(f"padded row vs the same row alone: {own:.2e}")
    assert own <= 5e-3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prefill_chunk": -3}, ValueError, "prefill_chunk"),
        ({"prefill_chunk": 0}, ValueError, "prefill_chunk"),
        ({"prefill_chunk": 2.5}, TypeError, "prefill_chunk"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": "64"}, TypeError, "block_size"),
        ({"fp8": "yes"}, TypeError, "fp8"),
        ({"record_topk": 1}, TypeError, "record_topk"),
        ({"attention": "flash"}, ValueError, "attention"),
    ],
)
def test_enable_rejects_bad_arguments(kwargs, error, match):
    model = hf.random_model(hf.tiny_config(num_hidden_layers=1))
    with pytest.raises(error, match=match):
        hf.enable(model, **kwargs)
    assert not hasattr(model, "sparse_mla")


def test_enable_rejects_a_model_that_is_not_deepseek_v32():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(TypeError, match=r"not a DeepSeek-V3\.2 \(DSA\).*LlamaForCausalLM"):
        hf.enable(LlamaForCausalLM(cfg))


def test_enable_rejects_transformers_it_was_not_written_for(monkeypatch):
    """Before 5.24 DeepseekV32 took ``past_key_values=``: a ``cache=`` keyword was silently
    dropped (generation with no history). Refused by version and by signature."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    model = hf.random_model(hf.tiny_config(num_hidden_layers=1))
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match=r"transformers 5\.17\.0.*>= ?5\.24"):
        hf.enable(model)
    monkeypatch.undo()

    def old_forward(self, hidden_states, position_embeddings, attention_mask,
                    past_key_values=None, position_ids=None, **kwargs):  # fmt: skip
        raise AssertionError("not called")

    monkeypatch.setattr(m.DeepseekV32Attention, "forward", old_forward)
    with pytest.raises(RuntimeError, match="cache"):
        hf.enable(model)
    monkeypatch.undo()
    assert not hasattr(model, "sparse_mla")


def test_enable_names_what_a_differing_transformers_lacks(monkeypatch):
    """Each way a release's DeepSeek-V3.2 can differ from the one the integration was written
    for is refused at enable(), naming the missing part, and nothing is patched."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    model = hf.random_model(hf.tiny_config(num_hidden_layers=1))
    layer = next(x for x in model.modules() if isinstance(x, m.DeepseekV32Attention))
    assert all(has_path(layer, name) for name in hf.LAYER_PARTS)  # this release: all
    forwards = {id(x): x.forward for x in model.modules()}

    def refused(match: str) -> None:
        with pytest.raises(RuntimeError, match=match) as e:
            hf.enable(model)
        assert "pip install 'transformers>=5.24,<5.26'" in str(e.value)
        assert not hasattr(model, "sparse_mla")
        assert all(x.forward == forwards[id(x)] for x in model.modules())
        monkeypatch.undo()

    monkeypatch.delattr(m, "apply_rotary_pos_emb_interleave")  # a helper renamed
    refused(r"lacks .*apply_rotary_pos_emb_interleave")
    monkeypatch.delattr(layer.indexer, "softmax_scale")  # an attribute renamed
    refused(r"DeepseekV32Attention differs .* no indexer\.softmax_scale")
    monkeypatch.delattr(layer, "kv_a_proj_with_mqa")  # a submodule renamed
    refused(r"no kv_a_proj_with_mqa")
    monkeypatch.setitem(sys.modules, "transformers.models.deepseek_v32", None)  # no such model
    refused(rf"transformers {re.escape(transformers.__version__)} has no DeepseekV32")


def test_enable_warns_on_a_transformers_newer_than_tested(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.30.0")
    with pytest.warns(UserWarning, match=r"tested with transformers >=5\.24,<5\.26; got 5\.30\.0"):
        hf.check_transformers()
