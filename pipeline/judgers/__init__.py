"""Judgers: score finished trajectories. A registry users extend, and the built-ins.

The registry in three lines::

    @register_judger("my_judge")            # any class with `async def judge(item)`
    class MyJudge: ...
    judger = get_judger("my_judge", **config)   # plugins: entry-point group "pipeline.judgers"

Built-ins: ``math``, ``exact_match``, ``regex``, ``code`` (sandboxed tests), ``llm``
(LLM-as-judge through an engine), ``http`` (a remote reward service) and ``function`` (a
synchronous reward function, run in a killable process pool). The ``Judge`` stage
(:mod:`pipeline.stages._judge`) runs them on each sample and fills ``reward``.
"""

from pipeline.judgers._base import (
    JUDGE_RECORDS,
    JudgeError,
    Judger,
    JudgeResult,
    JudgerRecord,
    JudgerRegistryError,
    JudgerTimeout,
    WorkerError,
    ground_truths,
    question_text,
    response_text,
)
from pipeline.judgers._code import CodeJudger
from pipeline.judgers._function import FunctionJudger
from pipeline.judgers._http import HttpJudger
from pipeline.judgers._llm import LLMJudger, parse_score
from pipeline.judgers._math import MathJudger, answers_equal, extract_answer
from pipeline.judgers._pool import ProcessPool
from pipeline.judgers._registry import (
    ENTRY_POINT_GROUP,
    JudgerRegistry,
    default_registry,
    get_judger,
    known_judgers,
    register_judger,
)
from pipeline.judgers._sandbox import Sandbox
from pipeline.judgers._sandbox_run import SandboxFacts, SandboxLimits, SandboxRun
from pipeline.judgers._text import ExactMatchJudger, RegexJudger

__all__ = [
    "ENTRY_POINT_GROUP",
    "JUDGE_RECORDS",
    "CodeJudger",
    "ExactMatchJudger",
    "FunctionJudger",
    "HttpJudger",
    "JudgeError",
    "JudgeResult",
    "Judger",
    "JudgerRecord",
    "JudgerRegistry",
    "JudgerRegistryError",
    "JudgerTimeout",
    "LLMJudger",
    "MathJudger",
    "ProcessPool",
    "RegexJudger",
    "Sandbox",
    "SandboxFacts",
    "SandboxLimits",
    "SandboxRun",
    "WorkerError",
    "answers_equal",
    "default_registry",
    "extract_answer",
    "get_judger",
    "ground_truths",
    "known_judgers",
    "parse_score",
    "question_text",
    "register_judger",
    "response_text",
]
