"""Stages: the protocol, ``Loop``, and the built-in stages."""

from pipeline.stages.base import FunctionStage, Loop, Stage, as_stage, run_stage
from pipeline.stages.generate import Generate
from pipeline.stages.judge import Judge, JudgerSpec
from pipeline.stages.prompt import BuildPrompt
from pipeline.stages.tools import CallTools

__all__ = [
    "BuildPrompt",
    "CallTools",
    "FunctionStage",
    "Generate",
    "Judge",
    "JudgerSpec",
    "Loop",
    "Stage",
    "as_stage",
    "run_stage",
]
