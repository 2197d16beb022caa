"""The main job's demo (random DeepSeek-V3.2 and DeepSeek-V4 models generating through
sparse-mla beside HF's own), shortened."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
# The model stays on the CPU here (the interpreter runs the kernels); on a CUDA machine it
# would have to move to the GPU first, which these tests do not do yet.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-interpreter test: the model is not moved to CUDA"
)

from sparse_mla import demo  # noqa: E402


def test_demo_generates_both_models_and_times_the_stages(capsys):
    assert demo.main(["--prompt", "12", "--new", "4"]) == 0
    text = capsys.readouterr().out
    assert "DeepseekV32ForCausalLM" in text and "DeepseekV4ForCausalLM" in text
    assert text.count("agreement: 4/4 tokens") == 2
    for stage in ("metadata", "cache writes", "logits", "top-k", "attention", "total"):
        assert stage in text
    assert "one more decode step, 3 layer(s): sparse-mla" in text
    assert text.rstrip().endswith("PASS")


def test_demo_runs_one_model(capsys):
    assert demo.main(["--model", "v4", "--prompt", "9", "--new", "2", "--layers", "2"]) == 0
    text = capsys.readouterr().out
    assert "DeepseekV32ForCausalLM" not in text and "2 layer(s) (sliding, csa)" in text
