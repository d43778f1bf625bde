"""``asyncio_run``, dumper installation rules, the progress heartbeat and the bind helpers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pipeline import BuildPrompt, Generate, Pipeline
from pipeline._net import bind_socket, start_site
from pipeline.diagnostics import (
    DUMP_DIR_ENV,
    DiagnosticsError,
    TaskDumper,
    Watchdog,
    asyncio_run,
    dump,
    install_task_dumper,
)
from pipeline.observability import ProgressHeartbeat
from pipeline.proxy import AddressInUseError
from pipeline.testing import ByteTokenizer, SimulatedEngine, capture_logs


@pytest.fixture(autouse=True)
def _dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))


def test_asyncio_run_returns_uses_uvloop_and_restores_the_signal(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    seen: dict[str, object] = {}

    async def main() -> int:
        seen["loop"] = type(asyncio.get_running_loop()).__module__
        seen["handler"] = signal.getsignal(signal.SIGUSR1)
        seen["dump"] = dump(reason="from main")
        return 42

    assert asyncio_run(main(), watchdog=Watchdog(0.5)) == 42
    assert seen["loop"].startswith("uvloop")
    assert callable(seen["handler"]) and seen["handler"] is not before
    assert signal.getsignal(signal.SIGUSR1) == before
    path = seen["dump"]
    assert path.parent == tmp_path / str(os.getpid())
    assert "reason=from main" in path.read_text()
    assert not (tmp_path / f"{os.getpid()}.json").exists()  # locator removed
    assert asyncio_run(main(), use_uvloop=False, watchdog=False) == 42
    assert seen["loop"].startswith("asyncio")


def test_asyncio_run_reports_tasks_left_running(tmp_path):
    never = asyncio.Event()

    async def forgotten() -> None:
        await never.wait()

    async def main() -> None:
        for i in range(3):
            asyncio.create_task(forgotten(), name=f"orphan-{i}")  # noqa: RUF006  # the leak
        await asyncio.sleep(0)

    with capture_logs() as logs:
        asyncio_run(main(), watchdog=False)
    [event] = [e for e in logs if e["event"] == "tasks_left_running"]
    assert event["count"] == 3 and sorted(event["tasks"]) == ["orphan-0", "orphan-1", "orphan-2"]
    [group] = event["groups"]
    assert group.startswith("3 x ") and "forgotten" in group and "Event.wait()" in group
    assert list(tmp_path.iterdir()) == []  # no dump written: no directory, locator or socket


def test_asyncio_run_watchdog_reports_a_block_in_main():
    def hold(seconds: float) -> None:
        time.sleep(seconds)

    async def main() -> None:
        await asyncio.sleep(0.05)
        hold(0.6)

    with capture_logs() as logs:
        asyncio_run(main(), watchdog=Watchdog(0.2))
    [event] = [e for e in logs if e["event"] == "event_loop_blocked"]
    assert "hold" in event["blocking"]


def test_a_second_dumper_on_the_same_signal_is_refused(tmp_path):
    with TaskDumper(tmp_path / "a") as first:
        assert first.installed_signal == signal.SIGUSR1
        with pytest.raises(DiagnosticsError, match="already handles SIGUSR1"):
            install_task_dumper(signal.SIGUSR1, directory=tmp_path / "b")
    second = install_task_dumper(signal.SIGUSR1, directory=tmp_path / "b")
    second.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_dumper_installed_off_the_main_thread_serves_the_socket(tmp_path):
    result: dict[str, object] = {}

    def install() -> None:
        with capture_logs() as logs:
            result["dumper"] = install_task_dumper(directory=tmp_path)
        result["logs"] = logs

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(10)
    dumper = result["dumper"]
    assert isinstance(dumper, TaskDumper)
    try:
        assert dumper.installed_signal is None
        assert any(e["event"] == "task_dump_signal_skipped" for e in result["logs"])
        locator = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
        assert locator["signal"] is None and locator["socket"] == str(dumper.socket_path)
        reply = _ask_socket(dumper.socket_path, b"dump\n")
        assert reply.endswith(".txt") and "reason=socket request" in Path(reply).read_text()
        assert _ask_socket(dumper.socket_path, b"hello\n").startswith("error")
    finally:
        dumper.close()
    assert not dumper.socket_path.exists()


def _ask_socket(path: Path, request: bytes) -> str:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(4096):
            reply += chunk
    return reply.decode().strip()


async def test_progress_heartbeat_logs_lines_while_the_batch_runs():
    engine = SimulatedEngine(latency_s=0.02, latency_sigma=0.0, tail_prob=0.0)
    pipe = Pipeline([BuildPrompt(offload=False), Generate()], engine=engine,
                    tokenizer=ByteTokenizer(), max_concurrency=4)
    with capture_logs() as logs:
        async with ProgressHeartbeat(pipe, interval_s=0.05, total=40) as beat:
            await pipe.run_batch([{"prompt": "hi"}] * 10, n=4)
            final = beat.fields()
    lines = [e for e in logs if e["event"] == "batch_heartbeat"]
    assert lines, "no progress line"
    assert all(0 <= e["done"] <= 40 and e["total"] == 40 for e in lines)
    assert any(e["running"] > 0 and e["by_stage"] for e in lines)
    assert [e["done"] for e in lines] == sorted(e["done"] for e in lines)
    assert final["done"] == 40 and final["running"] == 0
    with pytest.raises(Exception, match="interval_s"):
        ProgressHeartbeat(pipe, interval_s=0)


def test_bind_socket_retries_a_busy_port_until_it_is_free():
    holder = bind_socket("127.0.0.1", 0)
    port = holder.getsockname()[1]
    releaser = threading.Timer(0.3, holder.close)
    releaser.start()
    try:
        sock = bind_socket("127.0.0.1", port, attempts=40, retry_delay_s=0.05)
        assert sock.getsockname()[1] == port
        sock.close()
    finally:
        releaser.cancel()
        holder.close()


def test_bind_socket_gives_up_with_a_clear_error():
    holder = bind_socket("127.0.0.1", 0)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(AddressInUseError, match=f"127.0.0.1:{port} is still in use after 2"):
            bind_socket("127.0.0.1", port, attempts=2, retry_delay_s=0.01)
    finally:
        holder.close()


async def test_start_site_serves_on_the_port_it_returns():
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        _, port = await start_site(runner, "127.0.0.1", 0)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/") as resp:
                assert await resp.text() == "hi"
    finally:
        await runner.cleanup()


def test_a_forked_child_neither_dies_of_the_signal_nor_dumps_for_its_parent(tmp_path):
    with TaskDumper(tmp_path / "dumps") as dumper:
        pid = os.fork()
        if pid == 0:  # the child: signal itself, then leave without pytest's teardown
            code = 0
            try:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.2)
            except BaseException:
                code = 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # SIGUSR1 did not kill the child
        time.sleep(0.2)
        assert not list(dumper.directory.glob("tasks-*.txt"))
        assert dumper.faulthandler_path.read_text() == ""
        os.kill(os.getpid(), signal.SIGUSR1)  # the parent's own dumper still works
        deadline = time.monotonic() + 10
        while not list(dumper.directory.glob("tasks-*.txt")):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert "Thread 0x" in dumper.faulthandler_path.read_text() or "Current thread" in (
        dumper.faulthandler_path.read_text())
