"""The README's examples run and print what their comments say."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_its_examples():
    """The hot calls (logits, top-k, attention) and the metadata / remap API example."""
    assert len(EXAMPLES) == 2
    for call in ("index_logits", "select_topk", "sparse_mla_decode", "expand_decode_tokens"):
        assert any(f"sparse_mla.{call}(" in code for code in EXAMPLES), call


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_prints_what_it_claims(code: str):
    expected = [
        line.split("# ", 1)[1].split("]:")[0].rstrip(":") + ("]" if "]:" in line else "")
        for line in code.splitlines()
        if line.startswith("print(")
    ]
    assert expected
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, str(README), "exec"), {})
    assert buf.getvalue().splitlines() == expected
