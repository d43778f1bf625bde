"""What a sandboxed run is given and gives back: its limits, the machine's isolation, its outcome.

Plain frozen value objects (:class:`SandboxLimits`, :class:`SandboxFacts`) and the record of one
run (:class:`SandboxRun`); :class:`~pipeline.judgers.Sandbox` (``_sandbox``) uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        wall_s: wall-clock limit; the process group and every process of the run's uid are
            killed at it.
        cpu_s: CPU-time limit (default: ``ceil(wall_s) + 1``); SIGXCPU, then SIGKILL.
        memory_mb: address-space limit per process (Python itself needs about 30 MB).
        max_processes: processes and threads of the sandbox uid (enforced only when the
            privileges were dropped: root ignores it).
        max_file_mb: largest file the program may write (stdout and stderr included).
        max_open_files: open file descriptors per process.
        max_output_bytes: how much of stdout/stderr is kept for the report.
    """

    wall_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024


@dataclass(frozen=True, slots=True)
class SandboxFacts:
    """What isolation this machine gives (probed once per sandbox)."""

    privileges_dropped: bool
    network_isolated: bool
    python: str
    network_error: str | None = None
    mounts_isolated: bool = False
    """Private ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run`` (a mount namespace)."""
    mount_error: str | None = None


@dataclass(slots=True)
class SandboxRun:
    """The outcome of one sandboxed run.

    Attributes:
        exit_code: the program's exit code, or None when a signal ended it.
        signal: the signal that ended it (9 = killed, 24 = CPU limit, 25 = file size limit).
        timed_out: it ran past the wall limit and was killed.
        stdout / stderr: the first ``max_output_bytes`` of each (UTF-8, errors replaced).
        results: what the program wrote to fd 3, when ``results=True`` was asked.
        duration_s / cpu_s: wall and CPU time of the run.
        stragglers: processes of the run's uid still alive after the program ended, killed.
        uid: the uid it ran as (None: this process's own).
        network_isolated / mounts_isolated / privileges_dropped: the isolation that
            actually applied.
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    results: str | None
    duration_s: float
    cpu_s: float
    stragglers: int
    uid: int | None
    network_isolated: bool
    privileges_dropped: bool
    mounts_isolated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Exited with code 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out
