"""Diagnostics: see where a rollout is stuck, even when its event loop is blocked.

- :func:`capture_snapshot` returns every asyncio task (state, age, await chain, what it
  waits on), every thread's stack and the pipelines' in-flight samples, as data;
  :func:`render_text` / :func:`render_json` render it.
- :func:`install_task_dumper` (or :class:`TaskDumper`) writes a snapshot on SIGUSR1, on a
  request to its local socket, or on :func:`dump`; ``rollout dump PID``
  (:func:`dump_command`) asks a process for one and prints it.
- :class:`Watchdog` reports a blocked event loop with the blocking code, and a pipeline
  where no sample finished for a while; optionally it ends the process after a hard limit.
- :func:`asyncio_run` is the one sync entry point, with all of the above installed.
- :class:`ProgressHeartbeat` logs a long batch's progress; :func:`bind_socket` /
  :func:`start_site` bind servers with retries on a busy port.
"""

from pipeline.diagnostics._errors import AddressInUseError, DiagnosticsError
from pipeline.diagnostics._model import (
    LoopInfo,
    SampleInfo,
    Snapshot,
    TaskGroupInfo,
    TaskInfo,
    ThreadInfo,
)
from pipeline.diagnostics._paths import DUMP_DIR_ENV, default_dump_dir
from pipeline.diagnostics.cli import add_dump_arguments, dump_command, run_dump
from pipeline.diagnostics.dumper import TaskDumper, dump, install_task_dumper
from pipeline.diagnostics.net import bind_socket, bind_socket_async, start_site
from pipeline.diagnostics.progress import ProgressHeartbeat
from pipeline.diagnostics.render import render_json, render_text, snapshot_to_dict
from pipeline.diagnostics.run import asyncio_run
from pipeline.diagnostics.snapshot import capture_snapshot, track_task_ages
from pipeline.diagnostics.watchdog import BlockReport, LagStats, Watchdog

__all__ = [
    "DUMP_DIR_ENV",
    "AddressInUseError",
    "BlockReport",
    "DiagnosticsError",
    "LagStats",
    "LoopInfo",
    "ProgressHeartbeat",
    "SampleInfo",
    "Snapshot",
    "TaskDumper",
    "TaskGroupInfo",
    "TaskInfo",
    "ThreadInfo",
    "Watchdog",
    "add_dump_arguments",
    "asyncio_run",
    "bind_socket",
    "bind_socket_async",
    "capture_snapshot",
    "default_dump_dir",
    "dump",
    "dump_command",
    "install_task_dumper",
    "render_json",
    "render_text",
    "run_dump",
    "snapshot_to_dict",
    "start_site",
    "track_task_ages",
]
