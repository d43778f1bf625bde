"""Stages: the protocol, ``Loop``, ``Route``, the built-in stages, and the chat-template
rendering they tokenize turns with."""

from pipeline._data.models import TOOL_CALL_ERRORS
from pipeline._runner.context import Stage
from pipeline._runner.stage import FunctionStage, as_stage, as_stages, run_stage
from pipeline._text.render import (
    DRIFT_BOUNDARY,
    DRIFT_CLOSING,
    DRIFT_PREFIX,
    TurnDelta,
    chat_form,
    render_prompt,
    render_turn_delta,
)
from pipeline.stages._base import Loop
from pipeline.stages._env import ENV_DONE, ENV_METADATA, TURN_SCORES, GymEnvironment
from pipeline.stages._generate import LENGTH_LIMITS, Generate
from pipeline.stages._judge import Judge, JudgerSpec
from pipeline.stages._observe import append_observation
from pipeline.stages._prompt import BuildPrompt
from pipeline.stages._route import Route, agents_ran
from pipeline.stages._tools import CallTools
from pipeline.stages._user import USER_STOPPED, USER_TURNS, SimulatedUser, UserPolicy

__all__ = [
    "DRIFT_BOUNDARY",
    "DRIFT_CLOSING",
    "DRIFT_PREFIX",
    "ENV_DONE",
    "ENV_METADATA",
    "LENGTH_LIMITS",
    "TOOL_CALL_ERRORS",
    "TURN_SCORES",
    "USER_STOPPED",
    "USER_TURNS",
    "BuildPrompt",
    "CallTools",
    "FunctionStage",
    "Generate",
    "GymEnvironment",
    "Judge",
    "JudgerSpec",
    "Loop",
    "Route",
    "SimulatedUser",
    "Stage",
    "TurnDelta",
    "UserPolicy",
    "agents_ran",
    "append_observation",
    "as_stage",
    "as_stages",
    "chat_form",
    "render_prompt",
    "render_turn_delta",
    "run_stage",
]
