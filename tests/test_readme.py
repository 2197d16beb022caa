"""The README's example runs and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_prints_what_it_claims():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    expected = [
        line.split("# ", 1)[1].split("]:")[0].rstrip(":") + ("]" if "]:" in line else "")
        for line in code.splitlines()
        if line.startswith("print(")
    ]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, str(README), "exec"), {})
    assert buf.getvalue().splitlines() == expected
