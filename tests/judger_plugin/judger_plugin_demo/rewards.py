"""Synchronous reward functions for the process-pool tests (standard library only, so a
fresh worker imports them in milliseconds). Signature: verl's ``compute_score``."""

import os
import subprocess
import sys
import time
from typing import Any


def exact(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> dict:
    return {"score": float(solution_str.strip() == str(ground_truth)), "pid": os.getpid()}


def crash(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    raise ValueError(f"reward function bug on {{ {solution_str!r} }}")


def spin(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    while True:  # a hung, CPU-bound function
        pass


def slow(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    time.sleep(float(extra_info.get("sleep_s", 0.05)))  # blocking: would stall an event loop
    return 0.5


def die(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    os._exit(3)


def not_a_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> str:
    return "yes"


def write_child_pid(path: str, seconds: float) -> None:
    """Start a child in the worker's process group, record its pid in ``path``, then hang."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(path, "w") as fh:
        fh.write(str(child.pid))
    time.sleep(seconds)
