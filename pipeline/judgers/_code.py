"""The ``code`` judger: run the model's Python against the row's tests in a :class:`Sandbox`.

The program is the last fenced code block of the answer (```` ```python ```` preferred), else
the whole answer. The row's ``ground_truth`` holds the tests, in one of two forms (a JSON
string of either is accepted too):

- assert tests: a string of test code, a list of them, or ``{"tests": [...]}``. One
  process runs the program, then each test in the program's namespace, and reports each
  test's outcome on fd 3, line by line, so a timeout still shows which tests passed.
- stdin/stdout tests: ``{"inputs": [...], "outputs": [...]}``. One process per case; the
  output must equal the expected one up to trailing whitespace on each line and trailing
  blank lines.

The rule (docs/sandbox.md): what the submitted program does inside its sandbox is the
submission's doing. A failed test, an exception, an infinite loop, a fork bomb, a memory
hog, files of any shape, leftover processes, output floods, junk on the report channel,
limits hit, even a supervisor it took down: each is a score (0 where the tests did not pass)
with the reason in the payload, never a judger error, so it never masks the sample. Only
our infrastructure's failures raise :class:`JudgeError` and mask: the sandbox could not be
made, the launcher failed before the program was exec'd, the probe failed. Cleanup of a run
never raises. Assert tests run in the program's own process, so a program
written to cheat can subvert them (by patching builtins, say); stdin/stdout tests compare
output in this process and cannot be subverted that way.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from typing import Any

from pipeline._data.models import AgentRolloutItem
from pipeline.judgers._base import JudgeError, JudgeResult, response_text
from pipeline.judgers._registry import register_judger
from pipeline.judgers._sandbox import Sandbox
from pipeline.judgers._sandbox_run import SandboxLimits, SandboxRun

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)

_HARNESS = '''\
import json, os, sys
out = os.fdopen(3, "w", buffering=1)
with open("tests.json", encoding="utf-8") as fh:
    tests = json.load(fh)
ns = {"__name__": "__main__"}
try:
    with open("solution.py", encoding="utf-8") as fh:
        exec(compile(fh.read(), "solution.py", "exec"), ns)
except BaseException as exc:
    out.write(json.dumps({"solution_error": f"{type(exc).__name__}: {exc}"[:500]}) + "\\n")
    raise SystemExit(1)
for i, test in enumerate(tests):
    try:
        exec(compile(test, f"<test {i}>", "exec"), ns)
        out.write(json.dumps({"test": i, "ok": True}) + "\\n")
    except BaseException as exc:
        out.write(json.dumps({"test": i, "ok": False,
                              "error": f"{type(exc).__name__}: {exc}"[:500]}) + "\\n")
out.write(json.dumps({"done": True}) + "\\n")
'''


def extract_code(text: str) -> str | None:
    """The last ```` ```python ```` block, else the last fenced block, else the text itself."""
    blocks = _FENCE.findall(text)
    for lang, body in reversed(blocks):
        if lang.lower() in ("python", "py", "python3"):
            return str(body)
    if blocks:
        return str(blocks[-1][1])
    return text if text.strip() else None


def parse_tests(ground_truth: Any) -> tuple[str, list[Any]]:
    """``("asserts", [code, ...])`` or ``("io", [(stdin, expected), ...])`` from a row.

    Raises:
        JudgeError: the ground truth is in neither form.
    """
    value = ground_truth
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            value = json.loads(value)
        except ValueError:
            value = ground_truth
    if isinstance(value, dict) and "inputs" in value and "outputs" in value:
        inputs, outputs = value["inputs"], value["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or \
                len(inputs) != len(outputs):
            raise JudgeError("code tests: 'inputs' and 'outputs' must be lists of equal length")
        return "io", [(str(i), str(o)) for i, o in zip(inputs, outputs, strict=True)]
    if isinstance(value, dict) and "tests" in value:
        value = value["tests"]
    if isinstance(value, str):
        return "asserts", [value]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return "asserts", list(value)
    raise JudgeError("code tests: ground_truth must be test code, a list of it, "
                     "{'tests': [...]} or {'inputs': [...], 'outputs': [...]}")


def _same_output(actual: str, expected: str) -> bool:
    def canon(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return canon(actual) == canon(expected)


def _describe(run: SandboxRun) -> dict[str, Any]:
    return {"exit_code": run.exit_code, "signal": run.signal, "timed_out": run.timed_out,
            "duration_s": round(run.duration_s, 4), "stragglers_killed": run.stragglers,
            "uid": run.uid,
            "stderr": run.stderr[-1000:]}


@register_judger("code")
class CodeJudger:
    """Scores Python code by running the row's tests in a sandbox (see the module doc).

    Args:
        timeout_s: wall limit of one run (the assert run, or one stdin/stdout case).
        memory_mb: per-run memory limit (see :class:`SandboxLimits`).
        max_processes: per-run process limit (see :class:`SandboxLimits`).
        partial_credit: score the fraction of passed tests instead of all-or-nothing.
        max_cases: stdin/stdout cases run at most (the rest are not run and count as failed).
        concurrency: runs at once across samples (default: CPU count).
        network: give the program network access (default: none).
        sandbox: a shared :class:`Sandbox` (its owner closes it); default: the judger's own.
    """

    name = "code"

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 1024, max_processes: int = 32,
                 partial_credit: bool = False, max_cases: int = 50, concurrency: int | None = None,
                 network: bool = False, sandbox: Sandbox | None = None) -> None:
        self.limits = SandboxLimits(wall_s=timeout_s, memory_mb=memory_mb,
                                    max_processes=max_processes)
        self.partial_credit = partial_credit
        self.max_cases = max_cases
        self._owns_sandbox = sandbox is None
        self.sandbox = sandbox or Sandbox(self.limits, concurrency=concurrency, network=network)

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Run the tests; see the module doc.

        Raises:
            JudgeError: malformed tests in the row, or a sandbox failure.
        """
        kind, tests = parse_tests(item.data.ground_truth)
        code = extract_code(response_text(item))
        if code is None:
            return JudgeResult(score=0.0, payload={"passed": 0, "total": len(tests),
                                                   "status": "no_code"})
        facts = await self.sandbox.facts()
        if kind == "asserts":
            payload = await self._run_asserts(code, tests)
        else:
            payload = await self._run_io(code, tests)
        payload["sandbox"] = asdict(facts)
        passed, total = payload["passed"], payload["total"]
        if self.partial_credit:
            score = passed / total if total else 0.0
        else:
            score = 1.0 if total and passed == total else 0.0
        return JudgeResult(score=score, payload=payload)

    async def _run_asserts(self, code: str, tests: list[str]) -> dict[str, Any]:
        run = await self.sandbox.run(
            {"solution.py": code, "tests.json": json.dumps(tests), "harness.py": _HARNESS},
            ["harness.py"], results=True, limits=self.limits)
        outcomes: dict[int, dict[str, Any]] = {}
        solution_error = None
        done = False
        for line in (run.results or "").splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue  # the program wrote junk to fd 3: its tests do not count
            if not isinstance(record, dict):
                continue
            if "test" in record and isinstance(record["test"], int):
                outcomes.setdefault(record["test"], record)
            if record.get("solution_error") is not None:
                solution_error = str(record["solution_error"])[:500]
            done = done or record.get("done") is True
        passed = sum(1 for i in range(len(tests)) if outcomes.get(i, {}).get("ok") is True)
        if not done:
            passed = min(passed, len(tests) - 1)  # it did not finish: not everything passed
        status = ("timeout" if run.timed_out else "solution_error" if solution_error
                  else "passed" if done and passed == len(tests) else
                  "failed" if done else "crashed")
        failures = [{"test": i, "error": str(o.get("error"))[:500]}
                    for i, o in sorted(outcomes.items()) if o.get("ok") is not True][:5]
        return {"passed": max(passed, 0), "total": len(tests), "status": status,
                "solution_error": solution_error, "failures": failures, "run": _describe(run)}

    async def _run_io(self, code: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
        passed, status = 0, "passed"
        failures: list[dict[str, Any]] = []
        last: SandboxRun | None = None
        for index, (stdin, expected) in enumerate(cases[:self.max_cases]):
            last = await self.sandbox.run({"solution.py": code}, ["solution.py"], stdin=stdin,
                                          limits=self.limits)
            if last.ok and _same_output(last.stdout, expected):
                passed += 1
                continue
            status = ("timeout" if last.timed_out else "wrong_answer" if last.exit_code == 0
                      else "runtime_error")
            failures.append({"case": index, "status": status, "stdout": last.stdout[:500],
                             **_describe(last)})
            if not self.partial_credit:
                break
        if len(cases) > self.max_cases and status == "passed":
            status = "too_many_cases"
        return {"passed": passed, "total": len(cases), "status": status,
                "failures": failures[:5], "run": None if last is None else _describe(last)}

    async def aclose(self) -> None:
        """Close the judger's own sandbox."""
        if self._owns_sandbox:
            await self.sandbox.aclose()
