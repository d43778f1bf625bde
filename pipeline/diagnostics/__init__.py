"""Diagnostics: see where a rollout is stuck, even when its event loop is blocked.

- :func:`capture_snapshot` returns every asyncio task (state, age, await chain, what it
  waits on), every thread's stack and the pipelines' in-flight samples, as data;
  :func:`render_text` / :func:`render_json` render it.
- :func:`install_task_dumper` (or :class:`TaskDumper`) writes a snapshot on SIGUSR1, on a
  request to its local socket, or on :func:`dump`; ``rollout dump PID``
  (:func:`dump_command`) asks a process for one and prints it.
- :class:`Watchdog` reports a blocked event loop with the blocking code, and a pipeline
  where no sample finished for a while; optionally it ends the process after a hard limit.
- :func:`asyncio_run` is the one sync entry point, with all of the above installed and the
  collector tuned for a long batch (:func:`rollout_gc`, switchable off).
- :func:`diagnosed_loop` installs the same on an event loop the caller runs itself.
- :class:`InflightSample`: a running sample as :meth:`Pipeline.inflight` reports it.
"""

from pipeline._gc import rollout_gc
from pipeline._runner.host import InflightSample
from pipeline.diagnostics._cli import add_dump_arguments, run_dump
from pipeline.diagnostics._dumper import TaskDumper, dump, install_task_dumper
from pipeline.diagnostics._errors import DiagnosticsError
from pipeline.diagnostics._model import (
    LoopInfo,
    SampleInfo,
    Snapshot,
    TaskGroupInfo,
    TaskInfo,
    ThreadInfo,
)
from pipeline.diagnostics._paths import DUMP_DIR_ENV, default_dump_dir
from pipeline.diagnostics._render import render_json, render_text
from pipeline.diagnostics._run import asyncio_run, diagnosed_loop
from pipeline.diagnostics._sections import add_dump_section
from pipeline.diagnostics._snapshot import capture_snapshot
from pipeline.diagnostics._watchdog import BlockReport, LagStats, Watchdog

__all__ = [
    "DUMP_DIR_ENV",
    "BlockReport",
    "DiagnosticsError",
    "InflightSample",
    "LagStats",
    "LoopInfo",
    "SampleInfo",
    "Snapshot",
    "TaskDumper",
    "TaskGroupInfo",
    "TaskInfo",
    "ThreadInfo",
    "Watchdog",
    "add_dump_arguments",
    "add_dump_section",
    "asyncio_run",
    "capture_snapshot",
    "default_dump_dir",
    "diagnosed_loop",
    "dump",
    "install_task_dumper",
    "render_json",
    "render_text",
    "rollout_gc",
    "run_dump",
]
