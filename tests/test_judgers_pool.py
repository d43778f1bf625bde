"""ProcessPool and FunctionJudger: real worker processes, real kills, no zombies."""

from __future__ import annotations

import asyncio
import operator
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _waits import until

from pipeline import AgentMessage, AgentRolloutItem, artifacts, parse_row
from pipeline.judgers import FunctionJudger, JudgerTimeout, ProcessPool, WorkerError

PLUGIN_DIR = Path(__file__).parent / "judger_plugin"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def rewards(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The stdlib-only reward functions of the test plugin, importable by workers."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    from judger_plugin_demo import rewards

    return rewards


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def still_there(pids: list[int]) -> list[int]:
    """The pids that still have a /proc entry (a zombie has one: reaped ones do not)."""
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]




def item_for(answer: str, ground_truth: object = None, **extra: object) -> AgentRolloutItem:
    row = parse_row({"prompt": "q", "ground_truth": ground_truth, "extra": extra})
    return AgentRolloutItem(uid="u-0", group_id="u", data=row, artifacts={
        artifacts.MESSAGES: [AgentMessage(role="assistant", content=answer)]})


async def test_call_runs_in_another_process_and_reuses_the_worker() -> None:
    async with ProcessPool(1) as pool:
        first = await pool.call(os.getpid)
        second = await pool.call(os.getpid)
        assert first == second != os.getpid()
        assert await pool.call(operator.add, 2, 3) == 5
        assert await pool.call(sorted, [3, 1, 2], reverse=True) == [3, 2, 1]
        assert pool.started == 1


async def test_remote_exception_is_reported_and_the_worker_survives() -> None:
    async with ProcessPool(1) as pool:
        pid = await pool.call(os.getpid)
        with pytest.raises(WorkerError) as info:
            await pool.call(operator.truediv, 1, 0)
        assert info.value.remote_type == "ZeroDivisionError"
        assert "ZeroDivisionError" in (info.value.remote_traceback or "")
        assert "truediv raised ZeroDivisionError" in str(info.value)
        assert await pool.call(os.getpid) == pid


async def test_timeout_kills_the_worker_and_a_fresh_one_takes_over() -> None:
    async with ProcessPool(1) as pool:
        pid = await pool.call(os.getpid)
        started = time.monotonic()
        with pytest.raises(JudgerTimeout, match=r"ran past its 0\.2s limit"):
            await pool.call(time.sleep, 30, timeout_s=0.2)
        assert time.monotonic() - started < 10.0  # far below the 30 s sleep: the limit cut it
        await until(lambda: not alive(pid), 3)
        assert await pool.call(os.getpid) not in (pid, os.getpid())
        assert pool.killed == 1


async def test_timeout_counts_run_time_not_waiting_for_a_worker(rewards) -> None:  # type: ignore[no-untyped-def]
    # Two 0.3 s calls on one worker: the second waits 0.3 s, then runs 0.3 s < 0.5 s limit.
    async with ProcessPool(1) as pool:
        calls = [pool.call(time.sleep, 0.3, timeout_s=0.5) for _ in range(2)]
        assert await asyncio.gather(*calls) == [None, None]
        assert pool.killed == 0


async def test_a_worker_that_dies_is_reported_and_replaced() -> None:
    async with ProcessPool(1) as pool:
        with pytest.raises(WorkerError, match=r"died while running _exit \(exit code 3\)"):
            await pool.call(os._exit, 3)
        assert await pool.call(operator.mul, 6, 7) == 42


async def test_functions_that_cannot_be_pickled_fail_clearly() -> None:
    async with ProcessPool(1) as pool:
        with pytest.raises(WorkerError, match="importable top-level functions"):
            await pool.call(lambda: 1)
        assert pool.started == 0  # nothing was started for it


async def test_cancelling_a_call_kills_its_worker() -> None:
    async with ProcessPool(1) as pool:
        task = asyncio.create_task(pool.call(time.sleep, 30))
        await until(lambda: bool(pool.pids) and pool.started == 1, 3)
        pid = pool.pids[0]
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: not alive(pid), 3)
        assert await pool.call(operator.neg, 1) == -1


async def test_timeout_kills_the_functions_own_children(rewards, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pid_file = tmp_path / "child.pid"
    async with ProcessPool(1) as pool:
        with pytest.raises(JudgerTimeout):
            await pool.call(rewards.write_child_pid, str(pid_file), 30, timeout_s=1.5)
        child = int(pid_file.read_text())
        await until(lambda: not alive(child), 3)


async def test_aclose_ends_and_reaps_every_worker_with_calls_in_flight() -> None:
    pool = ProcessPool(3)
    hung = [asyncio.create_task(pool.call(time.sleep, 30)) for _ in range(2)]
    await until(lambda: len(pool.pids) == 2, 3)
    idle = await pool.call(os.getpid)  # a third worker, idle after this call
    pids = pool.pids
    assert len(pids) == 3 and idle in pids
    await pool.aclose()
    for task in hung:
        with pytest.raises(WorkerError):
            await task
    # Reaped, not zombies: the /proc entries are gone entirely.
    assert still_there(pids) == []
    assert pool.pids == []
    with pytest.raises(RuntimeError, match="closed"):
        await pool.call(os.getpid)
    await pool.aclose()  # idempotent


async def test_function_in_a_main_script_runs_in_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import asyncio
        from pipeline.judgers import ProcessPool

        def triple(x):
            return 3 * x

        async def main():
            async with ProcessPool(1) as pool:
                print(await pool.call(triple, 14))

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "42"


async def test_function_judger_runs_a_verl_style_reward_function(rewards) -> None:  # type: ignore[no-untyped-def]
    judger = FunctionJudger(rewards.exact, pool_size=1)
    try:
        right = await judger.judge(item_for(" 42 ", 42))
        wrong = await judger.judge(item_for("41", 42))
        assert right.score == 1.0 and wrong.score == 0.0
        assert right.payload["pid"] != os.getpid()
        assert judger.name == "exact"
        pids = judger.pool.pids
    finally:
        await judger.aclose()
    assert still_there(pids) == []


async def test_function_judger_inline_mode_and_bad_return_values(rewards) -> None:  # type: ignore[no-untyped-def]
    inline = FunctionJudger(rewards.exact, mode="inline")
    result = await inline.judge(item_for("7", 7))
    assert result.score == 1.0 and result.payload["pid"] == os.getpid()
    bad = FunctionJudger(rewards.not_a_score, mode="inline")
    with pytest.raises(Exception, match="expected a JudgeResult"):
        await bad.judge(item_for("7", 7))
