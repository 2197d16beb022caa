"""The main job's demo (a random DeepSeek-V3.2 generating through sparse-mla), shortened."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from sparse_mla import demo  # noqa: E402


def test_demo_generates_and_times_the_stages(capsys):
    assert demo.main(["--prompt", "12", "--new", "4"]) == 0
    text = capsys.readouterr().out
    assert "agreement: 4/4 tokens" in text
    for stage in ("metadata", "cache writes", "logits", "top-k", "attention", "total"):
        assert stage in text
    assert text.rstrip().endswith("PASS")
