"""Child process for the SIGKILL tests: a real batch dumping through ``TrajectoryWriter``.

Usage: ``python obs_kill_writer.py DUMP MODE``

- ``midline``: after the summary line and 5 sample lines, the next line is written in
  64-byte chunks; after its first chunk the process prints ``MIDLINE`` and waits to be
  killed, so the kill lands inside a line for sure.
- ``busy``: dump a long batch (one line per sample as it finishes) and print ``LINES n``
  after each line, until killed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from obs_batch import make_pipeline, rows

from pipeline.observability import TrajectoryWriter
from pipeline.observability import _writer as writer_module


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    writer = TrajectoryWriter(path, include_token_ids=True, chunk_bytes=64)
    real_write = os.write
    lines = 0

    def watching_write(fd: int, data: bytes) -> int:
        nonlocal lines
        written = real_write(fd, data)
        if fd == writer._fd:
            lines += bytes(data[:written]).count(b"\n")
            if mode == "midline" and lines >= 6 and not bytes(data[:written]).endswith(b"\n"):
                print("MIDLINE", flush=True)
                time.sleep(60)
        return written

    writer_module.os.write = watching_write  # type: ignore[attr-defined]

    def on_done(item, sample) -> None:  # type: ignore[no-untyped-def]
        writer.write(item, sample)
        if mode == "busy":
            print(f"LINES {writer.written}", flush=True)

    writer.begin_batch(step=0)
    pipeline = make_pipeline(latency_s=0.01, timeout_s=5.0)
    batch = [r for r in rows(400) if not r["extra"]["hang"]]
    asyncio.run(pipeline.run_batch(batch, n=1, on_sample_done=on_done))
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
