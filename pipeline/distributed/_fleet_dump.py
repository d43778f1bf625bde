"""The fleet's part of a dump: every worker's snapshot, asked for over Ray and rendered.

The pool registers it as the ``ray workers`` section of the driver's dumps, so ``rollout dump
<driver pid>`` shows the whole fleet. A worker that is being replaced, does not answer in time
or fails to answer gets a line that says so.
"""

from __future__ import annotations

from typing import Any

import ray

from pipeline.distributed._fleet import Slot


def fleet_section(slots: list[Slot], timeout_s: float) -> tuple[str, Any]:
    """Every worker's snapshot: ``(text, data)``. Blocks up to ``timeout_s``."""
    refs: dict[str, Any] = {}
    texts: list[str] = []
    data: dict[str, Any] = {}
    for slot in slots:
        worker = slot.worker
        if worker is not None and worker.alive:
            refs[worker.worker_id] = worker.handle.snapshot.remote("fleet dump")
        else:
            name = slot.info().worker_id
            texts.append(f"--- {name}: not running (being replaced) ---")
            data[name] = {"alive": False}
    ready: list[Any] = []
    if refs:
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for worker_id, ref in refs.items():
        if ref not in ready:
            texts.append(f"--- {worker_id}: no answer within {timeout_s:g}s ---")
            data[worker_id] = {"alive": True, "error": "no answer"}
            continue
        try:
            snap = ray.get(ref)
        except Exception as exc:
            texts.append(f"--- {worker_id}: {type(exc).__name__}: {str(exc)[:200]} ---")
            data[worker_id] = {"alive": False, "error": str(exc)[:200]}
            continue
        texts.append(f"--- {worker_id} (pid {snap['pid']}) ---\n{snap['text'].rstrip()}")
        data[worker_id] = snap["data"]
    return "\n".join(texts), data
