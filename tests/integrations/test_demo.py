"""The main job's demo (a random DeepSeek-V3.2 generating through sparse-mla), shortened."""

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


def test_demo_generates_and_times_the_stages(capsys):
    assert demo.main(["--prompt", "12", "--new", "4"]) == 0
    text = capsys.readouterr().out
    assert "agreement: 4/4 tokens" in text
    for stage in ("metadata", "cache writes", "logits", "top-k", "attention", "total"):
        assert stage in text
    assert text.rstrip().endswith("PASS")
