"""The public API: a sorted, importable ``__all__`` and no heavy imports."""

from __future__ import annotations

import subprocess
import sys

import pipeline


def test_all_is_sorted_and_importable():
    assert pipeline.__all__ == sorted(pipeline.__all__)
    for name in pipeline.__all__:
        assert getattr(pipeline, name) is not None, name


def test_import_needs_no_heavy_dependency():
    code = (
        "import sys, pipeline; heavy = [m for m in ('torch', 'transformers', 'vllm', 'ray') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
