"""The README's Python examples run as written, and its commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_python_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for code in blocks:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
