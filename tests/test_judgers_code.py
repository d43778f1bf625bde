"""The ``code`` judger and its sandbox: real subprocesses, real rlimits, real namespaces."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pipeline import AgentMessage, AgentRolloutItem, artifacts, parse_row
from pipeline.judgers import CodeJudger, JudgeError, Sandbox, SandboxLimits, get_judger
from pipeline.judgers._code import extract_code, parse_tests
from pipeline.judgers._rmtree import remove_tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sandbox")
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="uid isolation needs root")

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def item_for(answer: str, ground_truth: object) -> AgentRolloutItem:
    row = parse_row({"prompt": "write add(a, b)", "ground_truth": ground_truth})
    return AgentRolloutItem(uid="u-0", group_id="u", data=row, artifacts={
        artifacts.MESSAGES: [AgentMessage(role="assistant", content=answer)]})


def processes_of(uid: int | None) -> list[int]:
    if uid is None:
        return []
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(int(name))
            except FileNotFoundError:
                pass
    return found


def entries(path: Path) -> list[str]:
    return os.listdir(path)


def started(path: Path) -> bool:
    return any(os.path.exists(os.path.join(path, run, "work", "running"))
               for run in os.listdir(path))


@pytest.fixture
def sandbox_dir() -> Iterator[Path]:
    """This test's own place for run directories (the sandbox user may traverse it), so
    leftovers are counted exactly, whatever other tests run beside it."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def own(sandbox_dir: Path) -> AsyncIterator[CodeJudger]:
    """A judger whose sandbox makes its run directories in ``sandbox_dir``."""
    sandbox = Sandbox(SandboxLimits(wall_s=5.0), concurrency=2, directory=sandbox_dir)
    judge = CodeJudger(timeout_s=5.0, max_processes=16, memory_mb=512, sandbox=sandbox)
    yield judge
    await sandbox.aclose()


@pytest.fixture
async def judger():  # type: ignore[no-untyped-def]
    # 3 s: a correct or wrong solution must finish well inside it even on a loaded 2-core
    # machine (1 s timed out there); the infinite-loop cases take that long to end.
    judge = CodeJudger(timeout_s=3.0, max_processes=16, memory_mb=512, concurrency=2)
    yield judge
    await judge.aclose()


async def test_passing_and_failing_solutions(judger: CodeJudger) -> None:
    good = await judger.judge(item_for("Here you go:\n" + ADD, ADD_TESTS))
    assert good.score == 1.0
    assert good.payload["status"] == "passed" and good.payload["passed"] == 2
    wrong = await judger.judge(item_for(ADD.replace("a + b", "a * b"), ADD_TESTS))
    assert wrong.score == 0.0 and wrong.payload["status"] == "failed"
    assert wrong.payload["passed"] == 0  # 1*2 != 3 and -1*1 != 0
    assert "AssertionError" in wrong.payload["failures"][0]["error"]
    partial = CodeJudger(timeout_s=3.0, partial_credit=True, sandbox=judger.sandbox)
    half = await partial.judge(item_for(ADD.replace("a + b", "abs(a) + b"), ADD_TESTS))
    assert half.score == 0.5 and half.payload["passed"] == 1


async def test_sandbox_facts_are_reported(judger: CodeJudger) -> None:
    result = await judger.judge(item_for(ADD, ADD_TESTS))
    facts = result.payload["sandbox"]
    assert facts["privileges_dropped"] is ROOT
    assert isinstance(facts["network_isolated"], bool)
    assert os.path.isabs(facts["python"])


async def test_a_solution_that_exits_early_does_not_pass(judger: CodeJudger) -> None:
    cheat = await judger.judge(item_for("import sys\nsys.exit(0)", ADD_TESTS))
    assert cheat.score == 0.0 and cheat.payload["status"] == "solution_error"
    hard_exit = await judger.judge(item_for("import os\nos._exit(0)", ADD_TESTS))
    assert hard_exit.score == 0.0 and hard_exit.payload["status"] == "crashed"


async def test_infinite_loop_is_killed_at_the_wall_limit(judger: CodeJudger) -> None:
    started = time.monotonic()
    result = await judger.judge(item_for("while True:\n    pass", ADD_TESTS))
    assert time.monotonic() - started < 3.0 + 10  # the fixture's 3 s limit ended it
    assert result.score == 0.0
    assert result.payload["status"] == "timeout"
    assert result.payload["run"]["timed_out"] is True and result.payload["run"]["signal"] == 9


async def test_tests_that_passed_before_a_timeout_are_counted(judger: CodeJudger) -> None:
    partial = CodeJudger(timeout_s=1.0, partial_credit=True, sandbox=judger.sandbox)
    tests = ["assert add(1, 1) == 2", "while True: pass"]
    result = await partial.judge(item_for(ADD, tests))
    assert result.payload["status"] == "timeout"
    assert result.payload["passed"] == 1 and result.score == 0.5


@needs_root
async def test_fork_bomb_is_contained_and_swept(judger: CodeJudger) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    started = time.monotonic()
    result = await judger.judge(item_for(bomb, ADD_TESTS))
    assert time.monotonic() - started < 3.0 + 10  # the 3 s limit, load-tolerant
    assert result.score == 0.0 and result.payload["status"] == "timeout"
    run = result.payload["run"]
    assert 0 < run["stragglers_killed"] <= 16  # the process limit held
    assert processes_of(run["uid"]) == []
    # The machine is fine: the next run works.
    assert (await judger.judge(item_for(ADD, ADD_TESTS))).score == 1.0


async def test_memory_hog_is_stopped_by_the_address_space_limit(judger: CodeJudger) -> None:
    small = CodeJudger(timeout_s=5.0, memory_mb=200, sandbox=judger.sandbox)
    for hog in ("x = bytearray(8 * 1024 ** 3)",
                "chunks = []\nwhile True:\n    chunks.append(bytearray(48 * 1024 ** 2))"):
        result = await small.judge(item_for(hog, ADD_TESTS))
        assert result.score == 0.0
        assert result.payload["status"] == "solution_error", result.payload
        assert "MemoryError" in result.payload["solution_error"]
        assert result.payload["run"]["duration_s"] < 5.0  # the memory limit, not the 5 s one


@needs_root
async def test_escaped_background_processes_are_killed(judger: CodeJudger) -> None:
    daemon = ("import os, time\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        time.sleep(60)\n"
              "    os._exit(0)\n" + ADD.strip("`").removeprefix("python\n"))
    result = await judger.judge(item_for(daemon, ADD_TESTS))
    assert result.score == 1.0
    run = result.payload["run"]
    assert run["stragglers_killed"] >= 1
    assert processes_of(run["uid"]) == []


@needs_root
async def test_program_runs_unprivileged_with_an_empty_environment(judger: CodeJudger) -> None:
    tests = ["import os\nassert os.getuid() != 0 and os.getgid() != 0 and os.getgroups() == []",
             "import os\nassert 'HOME' not in os.environ and 'PATH' not in os.environ",
             "try:\n    open('/etc/shadow').read()\nexcept PermissionError:\n    pass\n"
             "else:\n    raise AssertionError('read /etc/shadow')",
             "import resource\nassert resource.getrlimit(resource.RLIMIT_NPROC)[0] == 16"]
    result = await judger.judge(item_for("x = 1", tests))
    assert result.payload["status"] == "passed", result.payload
    assert result.score == 1.0


async def test_no_network_inside_the_sandbox(judger: CodeJudger) -> None:
    facts = await judger.sandbox.facts()
    if not facts.network_isolated:
        pytest.skip(f"this machine gives no network namespace: {facts.network_error}")
    connections = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        test = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                "except OSError:\n    pass\nelse:\n    raise AssertionError('connected')")
        result = await judger.judge(item_for("x = 1", [test]))
    finally:
        server.close()
        await server.wait_closed()
    assert result.payload["status"] == "passed", result.payload
    assert connections == 0


async def test_stdin_stdout_cases(judger: CodeJudger) -> None:
    tests = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]})
    solution = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert (await judger.judge(item_for(solution, tests))).score == 1.0
    wrong = await judger.judge(item_for(solution.replace("a + b", "a - b"), tests))
    assert wrong.score == 0.0 and wrong.payload["status"] == "wrong_answer"
    assert wrong.payload["failures"][0]["stdout"] == "-1\n"
    crash = await judger.judge(item_for("raise SystemExit(2)", tests))
    assert crash.payload["status"] == "runtime_error"


async def test_cancelled_run_is_cleaned_up(own: CodeJudger, sandbox_dir: Path) -> None:
    slow = CodeJudger(timeout_s=60.0, sandbox=own.sandbox)  # only the cancel ends it
    program = "open('running', 'w').close()\nwhile True:\n    pass"
    task = asyncio.create_task(slow.judge(item_for(program, ADD_TESTS)))
    deadline = time.monotonic() + 30.0
    while not started(sandbox_dir):  # the program really runs
        assert not task.done(), task
        assert time.monotonic() < deadline, "the program never started"
        await asyncio.sleep(0.01)
    # The uid this run got (the owner of what the program wrote). Not ``uids[:4]``: sandboxes
    # elsewhere (other xdist workers, other processes on the machine) lease from the same range
    # and may be running programs under those uids right now.
    (run,) = os.listdir(sandbox_dir)
    uid = os.stat(sandbox_dir / run / "work" / "running").st_uid
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await own.sandbox.aclose()  # waits for the stop and the sweep
    if uid != os.geteuid():  # without root the program runs as this user: no uid of its own
        assert processes_of(uid) == []
    assert entries(sandbox_dir) == []


async def test_malformed_tests_and_missing_code() -> None:
    with pytest.raises(JudgeError, match="ground_truth must be"):
        parse_tests({"cases": []})
    with pytest.raises(JudgeError, match="equal length"):
        parse_tests({"inputs": ["1"], "outputs": []})
    assert parse_tests('{"tests": ["assert 1"]}') == ("asserts", ["assert 1"])
    assert extract_code("text\n```js\nx\n```\n```py\ny = 1\n```\nbye") == "y = 1\n"
    assert extract_code("   ") is None
    judge = get_judger("code", timeout_s=1.0)
    try:
        result = await judge.judge(item_for("", ADD_TESTS))
        assert result.score == 0.0 and result.payload["status"] == "no_code"
    finally:
        await judge.aclose()  # type: ignore[attr-defined]


async def test_sandboxes_in_one_process_lease_different_uids() -> None:
    if not ROOT:
        pytest.skip("uids are leased only as root")
    async with Sandbox(SandboxLimits(wall_s=1.0), concurrency=2) as first, \
            Sandbox(SandboxLimits(wall_s=1.0), concurrency=2) as second:
        await first.facts()
        await second.facts()
        mine = {(await first.run({"a.py": "import os; print(os.getuid())"}, ["a.py"])).uid}
        theirs = {(await second.run({"a.py": "print(1)"}, ["a.py"])).uid}
        assert mine.isdisjoint(theirs)


# --- hostile programs: the submission's doing scores, it never masks the sample -----------

WRONG_ADD = "\ndef add(a, b):\n    return a - b\n"
HOSTILE = {
    "deep_directory_tree": (
        "import os\n"
        "for _ in range(1200):\n"  # past Python's recursion limit, 30 times PATH_MAX
        "    os.mkdir('d' * 100)\n"
        "    os.chdir('d' * 100)\n"),
    "odd_files": (
        "import os, socket\n"
        "os.makedirs('locked/inner')\n"
        "open('locked/inner/f', 'w').write('x')\n"
        "os.chmod('locked/inner', 0)\n"
        "os.chmod('locked', 0)\n"
        "os.makedirs('ro/x')\n"
        "os.chmod('ro', 0o500)\n"
        "os.mkfifo('fifo')\n"
        "socket.socket(socket.AF_UNIX).bind('sock')\n"
        "os.symlink('/', 'root_link')\n"
        "os.symlink('..', 'up')\n"
        "os.symlink('fifo', 'to_fifo')\n"
        "os.symlink('missing', 'dangling')\n"
        "open('new\\nline \\udcff'.encode('utf-8', 'surrogateescape'), 'w').close()\n"
        "os.chmod('.', 0o500)\n"),
    "many_small_files": (
        "for i in range(1000):\n"
        "    open(f'f{i}', 'w').close()\n"),
    "stdout_flood": (
        "import sys\n"
        "chunk = 'x' * 65536\n"
        "while True:\n"
        "    sys.stdout.write(chunk)\n"),
    "junk_on_the_report_channel": (
        "import os\n"
        "os.write(3, b'[' * 300000 + b'\\n' + b'{\"solution_error\": {\"a\": [1]}}\\n'"
        " + b'\\xff\\xfe not json\\n')\n"),
    "open_files_limit": (
        "handles = []\n"
        "try:\n"
        "    while True:\n"
        "        handles.append(open('same', 'w'))\n"
        "except OSError:\n"
        "    pass\n"),
    "file_size_limit": "open('big', 'wb').write(b'x' * (40 << 20))\n",
    "leftover_processes": (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        n = 0\n"
        "        while True:\n"  # keeps making files while we clean up, until swept
        "            open(f'spam{n % 500}', 'w').close()\n"
        "            n += 1\n"
        "    os._exit(0)\n"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_hostile_program_scores_zero_and_leaves_nothing(own: CodeJudger,
                                                              sandbox_dir: Path,
                                                              kind: str) -> None:
    """Each class of mischief inside the sandbox: the wrong answer still scores 0 (no judge
    error, so the sample is not masked), and the run's directory and processes are gone."""
    if kind == "leftover_processes" and not ROOT:
        pytest.skip("escaped processes are swept by uid: needs root")
    result = await own.judge(item_for(HOSTILE[kind] + WRONG_ADD, ADD_TESTS))
    assert result.score == 0.0, result.payload
    assert result.payload["status"] in {"failed", "solution_error", "crashed", "timeout"}
    assert entries(sandbox_dir) == []
    assert processes_of(result.payload["run"]["uid"]) == []
    # The same program with the right answer passes: the mess itself costs nothing.
    if kind not in ("stdout_flood", "file_size_limit"):  # these never reach the tests
        good = await own.judge(item_for(HOSTILE[kind] + ADD.strip("`").removeprefix("python\n"),
                                        ADD_TESTS))
        assert good.score == 1.0, good.payload
        assert entries(sandbox_dir) == []


# --- private /tmp, /var/tmp, /dev/shm, /run: host sockets out of reach ----------------------

SYSTEM_PYTHON = shutil.which("python3", path=os.defpath)


@pytest.fixture
def host_sockets() -> Iterator[tuple[Path, str, list[int]]]:
    """A world-writable pathname socket under the host's /tmp (in a world-traversable
    directory) and an abstract one, both accepting; yields their names and a hit counter."""
    folder = Path(tempfile.mkdtemp(prefix="host-sock-", dir="/tmp"))
    os.chmod(folder, 0o755)
    path = folder / "open.sock"
    abstract = f"\0pipeline-test-{os.getpid()}-{time.monotonic_ns()}"
    hits = [0]
    servers = []
    for address in (str(path), abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(8)
        server.settimeout(0.2)
        servers.append(server)
    os.chmod(path, 0o777)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for server in servers:
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                hits[0] += 1
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path, abstract, hits
    finally:
        stop.set()
        thread.join(timeout=5)
        for server in servers:
            server.close()
        shutil.rmtree(folder, ignore_errors=True)


CONNECT = """
import socket, sys
for address in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(address.replace("@", "\\0", 1))
    s.close()
"""


@needs_root
async def test_host_unix_sockets_are_out_of_reach(own: CodeJudger, host_sockets) -> None:
    path, abstract, hits = host_sockets
    facts = await own.sandbox.facts()
    if not (facts.mounts_isolated and facts.network_isolated):
        pytest.skip(f"no namespaces here: {facts.mount_error} / {facts.network_error}")
    # Positive control: another unprivileged uid outside the sandbox does reach both.
    assert SYSTEM_PYTHON is not None
    done = await asyncio.to_thread(
        subprocess.run, [SYSTEM_PYTHON, "-I", "-c", CONNECT, str(path), "@" + abstract[1:]],
        user=65534, group=65534, extra_groups=[], capture_output=True, timeout=30, cwd="/")
    assert done.returncode == 0, done.stderr
    reached = hits[0]
    assert reached == 2
    tests = [
        "import socket\n"
        f"for address in ({str(path)!r}, {abstract!r}):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    try:\n"
        "        s.connect(address)\n"
        "    except OSError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(f'reached {address!r}')",
        # Private, empty and writable: a program may still use /tmp for itself.
        "import os\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', '/run'):\n"
        "    if os.path.isdir(d):\n"
        "        assert os.listdir(d) == [], (d, os.listdir(d))\n"
        "open('/tmp/scratch', 'w').write('mine')\n"
        "assert open('/tmp/scratch').read() == 'mine'",
    ]
    result = await own.judge(item_for("x = 1", tests))
    assert result.payload["status"] == "passed", result.payload
    assert result.payload["sandbox"]["mounts_isolated"] is True
    assert hits[0] == reached  # no connection came from the sandbox


def test_remove_tree_removes_what_a_program_leaves(tmp_path: Path) -> None:
    """Deeper than the recursion limit and PATH_MAX, unreadable directories, fifos, sockets,
    symlinks to the outside (never followed)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    root = tmp_path / "run"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1100):
            os.mkdir("d" * 100, dir_fd=fd)
            child = os.open("d" * 100, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "f").write_text("x")
    os.chmod(root / "locked" / "inner", 0)
    os.chmod(root / "locked", 0)
    os.mkfifo(root / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock"))
    (root / "out").symlink_to(outside)
    (root / "out_file").symlink_to(outside / "keep")
    os.chmod(root, stat.S_IRUSR | stat.S_IXUSR)
    assert remove_tree(root) is None
    assert not root.exists()
    assert (outside / "keep").read_text() == "keep"
    assert remove_tree(root) is None  # already gone: fine


@needs_root
async def test_a_launch_that_fails_before_the_exec_is_our_error(sandbox_dir: Path) -> None:
    """The other side of the rule: when the program never ran, the judge raises (the sample
    is masked) instead of scoring the submission."""
    not_a_program = sandbox_dir / "bin"
    not_a_program.mkdir(mode=0o755)  # "executable" to access(), but execve refuses it
    # (host mounts: a private /tmp would hide it from the probe, which refuses it at once)
    sandbox = Sandbox(SandboxLimits(wall_s=2.0), python=str(not_a_program),
                      directory=sandbox_dir, private_mounts=False)
    judge = CodeJudger(timeout_s=2.0, sandbox=sandbox)
    try:
        with pytest.raises(JudgeError, match="could not start the program"):
            await judge.judge(item_for(ADD, ADD_TESTS))
    finally:
        await sandbox.aclose()
    assert entries(sandbox_dir) == ["bin"]  # the run's directory is gone all the same


REMOVE_AS_OWNER = """
import contextlib, os, stat, sys
from pathlib import Path
from typing import Any
{source}
root = Path(sys.argv[1])
root.mkdir()
(root / "locked" / "inner").mkdir(parents=True)
(root / "locked" / "inner" / "f").write_text("x")
os.chmod(root / "locked" / "inner", 0)
os.chmod(root / "locked", 0)
(root / "ro" / "x").mkdir(parents=True)
(root / "ro" / "x" / "f").write_text("x")
os.chmod(root / "ro" / "x", 0o500)
os.chmod(root / "ro", 0o500)
os.mkfifo(root / "fifo")
os.symlink("/", root / "root_link")
os.chmod(root, 0o500)
problem = remove_tree(root)
assert problem is None and not root.exists(), problem
"""


@needs_root
def test_remove_tree_as_an_unprivileged_owner(sandbox_dir: Path) -> None:
    """Without root, unreadable and read-only directories need a chmod first: run the very
    same functions as another uid on a tree that uid made."""
    import inspect

    from pipeline.judgers import _rmtree

    source = "\n".join(inspect.getsource(f) for f in (
        _rmtree.remove_tree, _rmtree._open_dir, _rmtree._clear_files))
    source = f"_DIR_FLAGS = {_rmtree._DIR_FLAGS}\n{source}"
    os.chmod(sandbox_dir, 0o1777)
    assert SYSTEM_PYTHON is not None
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", REMOVE_AS_OWNER.format(source=source),
                           str(sandbox_dir / "run")], user=65534, group=65534,
                          extra_groups=[], capture_output=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert entries(sandbox_dir) == []
