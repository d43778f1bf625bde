"""The README's Python examples run as written, and its commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
# An example that starts a Ray cluster runs in the Ray group, one cluster at a time
# (tests/conftest.py).
RAY = pytest.mark.xdist_group("ray")
PARAMS = [pytest.param(code, id=f"block{i}", marks=[RAY] if re.search(r"\b[Rr]ay", code) else [])
          for i, code in enumerate(BLOCKS)]


@pytest.mark.parametrize("code", PARAMS)
def test_python_examples_run(tmp_path, code):
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_examples_do_not_hide_the_package():
    """A variable named ``pipeline`` would shadow the package (``pipeline.asyncio_run``)."""
    assert len(BLOCKS) >= 5
    for code in BLOCKS:
        assert not re.search(r"^\s*pipeline\s*=", code, flags=re.M), code[:200]


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
