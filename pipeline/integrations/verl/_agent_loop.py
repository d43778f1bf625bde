"""The agent loop verl's workers instantiate: a user's stage list inside ``AgentLoopWorker``.

verl's worker (a Ray actor) builds one agent loop per sample with ``hydra.utils.instantiate``
from its registry, which it fills from ``rollout.agent.agent_loop_config_path`` (YAML entries
``name``, ``_target_``, options) and from ``@register``. Our options name a factory by dotted
path (the one place we accept one: verl's config is text); it is resolved, called and checked
the first time a worker instantiates the entry, and a mistake fails at once, naming the entry.
The pipeline it gives is built once per worker and entry (its limiters are shared by the
worker's samples); each sample then runs through it with our timeouts and isolation.

``run()`` never raises for a sample: verl gathers a worker's samples without isolation (one
exception fails the worker's batch; on V1 it fails the whole prompt group), so a failed
sample is an output whose response mask is all zero. The reward a sample carries, whichever
stage wrote it, is handed to verl; whether an entry scores at all is decided by its samples
(see :mod:`pipeline.integrations.verl._reward`) unless the ``judges`` option says it.

A ``Route`` in the stage list routes on the row: its ``agent`` column when the dataset has
one, else verl's ``agent_name`` when that names one of the Route's agents (verl picks the
entry by ``agent_name``, so it is the entry's name: list one entry per agent, all naming the
same factory), else the Route's default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from collections.abc import Mapping
from typing import Any

import structlog

from pipeline import artifacts as A
from pipeline._data.config import PipelineConfig, merge_config
from pipeline._data.models import AgentRolloutItem, FinishReason, RolloutSample, Status
from pipeline._data.plain import plain
from pipeline._exceptions import ConfigError
from pipeline._runner.context import Resources
from pipeline._runner.fill import fill_sample, minimal_sample
from pipeline._runner.pipeline import Pipeline
from pipeline.batch import reward_extra_info, to_verl_outputs
from pipeline.integrations.verl._engine import STEPS, StepRange, VerlServerEngine
from pipeline.integrations.verl._factory import make_stages
from pipeline.integrations.verl._imports import import_verl
from pipeline.integrations.verl._reward import Scoring
from pipeline.stages import Loop, Route, Stage

_logger = structlog.get_logger("pipeline.integrations.verl")

OPTIONS = ("factory", "factory_kwargs", "sample_timeout_s", "max_concurrency", "sampling",
           "judges", "reward_extra_keys")
"""Options a YAML entry may set for :class:`PipelineAgentLoop` (besides ``name``/``_target_``)."""

_VERL_ARGS = ("trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls",
              "data_config", "hf_model_type", "tools")
"""What verl's worker passes every agent loop (``tools`` is verl's own tool list: unused)."""

AGENT = "agent"
"""``extra_fields`` key naming the agent that ran the sample: the ``Route``'s choice when the
stage list routed it, else the YAML entry (verl's ``agent_name``)."""

_ROW_KEYS = ("tools_kwargs", "index", "data_source", "reward_model", "extra_info")


def _route_names(stages: list[Stage]) -> set[str]:
    """The agent names of every ``Route`` in a stage list (inside loops and routes too)."""
    names: set[str] = set()
    for stage in stages:
        if isinstance(stage, Loop):
            names |= _route_names(stage.stages)
        elif isinstance(stage, Route):
            names |= set(stage.agents)
            for agent_stages in stage.agents.values():
                names |= _route_names(agent_stages)
    return names


@dataclasses.dataclass
class _Agent:
    """One YAML entry as built in one worker: the pipeline and what the output needs."""

    pipeline: Pipeline
    engine: VerlServerEngine
    scoring: Scoring
    route_names: set[str]
    reward_extra_keys: list[str]
    prompt_length: int
    response_length: int


_BUILT: weakref.WeakKeyDictionary[Any, dict[str, _Agent]] = weakref.WeakKeyDictionary()
"""Per verl client (one per worker): the entries built so far, by name and options."""


class PipelineAgentLoop:
    """A verl agent loop that runs a stage list of ours (verl 0.9.1).

    Register it from YAML (``rollout.agent.agent_loop_config_path``)::

        - name: math_tools
          _target_: pipeline.integrations.verl.PipelineAgentLoop
          factory: my_pkg.agents.math_tools      # returns a stage list or a Pipeline
          factory_kwargs: {max_turns: 4}
          sample_timeout_s: 120
          reward_extra_keys: [acc]

    or in Python with :func:`register_agent_loop`. A factory that returns a ``Pipeline``
    keeps its tools, judgers, limiters, config and fill; its engine and tokenizer are replaced
    by verl's server (:class:`VerlServerEngine`) and tokenizer.

    Options:
        factory: dotted path of a callable returning the stage list or a ``Pipeline``.
        factory_kwargs: keyword arguments for it.
        sample_timeout_s, max_concurrency: the pipeline's (per worker).
        sampling: our sampling fields (``max_tokens`` per turn, ``stop_token_ids``, ...);
            temperature, top-p and top-k come from verl per call, the response budget is
            ``rollout.response_length``.
        judges: an override of who scores. Absent (the default): each sample's own reward
            (whichever stage wrote ``artifacts.REWARD``: a ``Judge`` anywhere, a custom
            stage, a bare function; 0.0 included) is its ``reward_score``; the entry's
            samples decide together whether it scores (see ``_reward``), so a masked one
            gets 0.0 beside scored ones and None beside unscored ones. ``true``: the entry
            scores; every output has a ``reward_score`` (0.0 when masked). ``false``: every
            output has None and verl's reward loop scores them, whatever the stage list
            wrote. An unmasked sample without a reward in an entry that scores (or, absent
            the option, with one in an entry whose samples carry none) is masked with an
            error: verl would drop the whole worker's ``rm_scores`` or score it with its
            own function.
        reward_extra_keys: the reward payload's numeric leaves that become
            ``reward_extra_info`` of a scored output (NaN where a sample lacks one). verl
            reads the keys of one sample on all others, so they are pinned; default: none.

    A ``Route`` in the stage list routes on the row's ``agent`` column, else on verl's
    ``agent_name`` (the entry's name) when it is one of the Route's agents, else on its
    default; ``extra_fields["agent"]`` then names the Route's choice.

    Raises:
        ConfigError: an unknown option, a factory that cannot be imported or resolved,
            that raises or returns no valid stage list, naming the YAML entry.
    """

    def __init__(self, *, name: str | None = None, **kwargs: Any) -> None:
        verl_args = {k: kwargs.pop(k, None) for k in _VERL_ARGS}
        self.name = str(name) if name is not None else "pipeline"
        where = (f"verl agent loop {self.name!r} (rollout.agent.agent_loop_config_path "
                 "entry)")
        unknown = sorted(set(kwargs) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"{where}: unknown option(s) {unknown}; known: {list(OPTIONS)}",
                              field=unknown[0])
        options = {k: plain(v) for k, v in kwargs.items()}
        if "factory" not in options:
            raise ConfigError(f"{where}: option 'factory' is missing (the dotted path of a "
                              "function returning the stage list)", field="factory")
        client = verl_args["server_manager"]
        key = json.dumps([self.name, options], sort_keys=True, default=repr)
        built = _BUILT.get(client) if _weakrefable(client) else None
        agent = None if built is None else built.get(key)
        if agent is None:
            agent = _build(where, options, verl_args)
            if _weakrefable(client):
                _BUILT.setdefault(client, {})[key] = agent
        self.agent = agent

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """Run one sample; returns verl's ``AgentLoopOutput``, never raises for the sample.

        Args:
            sampling_params: verl's (``temperature``, ``top_p``, ``top_k``, ...).
            **kwargs: the sample's dataset fields (``raw_prompt``, ``uid``, ``session_id``
                on V1, ``reward_model``, ``extra_info``, ...).
        """
        agent = self.agent
        steps = StepRange()
        item: AgentRolloutItem | None = None
        sample: RolloutSample | None = None
        agent.scoring.started()
        try:
            try:
                item = self._item(sampling_params, kwargs)
                token = STEPS.set(steps)
                try:
                    sample = await _run_one(agent.pipeline, item)
                finally:
                    STEPS.reset(token)
            except Exception as exc:  # a row verl gave us that we cannot read: an output
                error = f"{type(exc).__name__}: {exc}"
                _logger.error("verl_sample_unreadable", agent=self.name, error=error)
                sample = _unreadable(item, kwargs, agent.pipeline.pad_token_id, error)
        finally:
            agent.scoring.finished(carries_reward=sample is not None and _carries_reward(
                sample, item), masked=sample is None or sample.masked)
        if steps.min_global_steps is None:  # no reply from the server (failed, timed out):
            # the prompt's own step (V1 passes it; its trainer casts these tags to int)
            step = plain(kwargs.get("global_steps"))
            if isinstance(step, int):
                steps.min_global_steps = steps.max_global_steps = step
        scores = agent.scoring.scores
        if sample.masked and not _carries_reward(sample, item):
            scores = await agent.scoring.decision()
        return self._output(sample, item, steps, scores)

    def _item(self, sampling_params: Mapping[str, Any], kwargs: Mapping[str, Any]
              ) -> AgentRolloutItem:
        verl_row = {k: plain(v) for k, v in kwargs.items()}
        extra: dict[str, Any] = {"verl": verl_row}
        own = verl_row.get("agent")  # the dataset's own agent column (None, NaN, "": none)
        if own is not None and own == own and own != "":
            extra["agent"] = own
        agent_name = verl_row.get("agent_name") or self.name  # verl consumes it: the entry's
        if agent_name in self.agent.route_names:
            extra["agent_name"] = agent_name
        row: dict[str, Any] = {"messages": verl_row.get("raw_prompt"), "extra": extra}
        for key in _ROW_KEYS:
            if verl_row.get(key) is not None:
                row[key] = verl_row[key]
        pipeline = self.agent.pipeline
        item = pipeline.make_items([row], 1)[0]
        group = verl_row.get("uid")
        session = verl_row.get("session_id")
        if group is not None:
            item.group_id = str(group)
        k = int(session) if isinstance(session, int) else None
        item.sample_index = k or 0
        item.uid = f"{item.group_id}-{k if k is not None else os.urandom(4).hex()}"
        cap = self.agent.response_length
        base = item.sampling
        update: dict[str, Any] = {"max_tokens": min(base.max_tokens, cap),
                                  "max_response_tokens": min(base.max_response_tokens or cap,
                                                             cap)}
        for field in ("temperature", "top_p", "top_k"):
            if sampling_params.get(field) is not None:
                update[field] = sampling_params[field]
        item.sampling = base.with_overrides(update, where="verl sampling_params")
        return item

    def _output(self, sample: RolloutSample, item: AgentRolloutItem | None,
                steps: StepRange, scores: bool | None) -> Any:
        agent = self.agent
        sample = sample.model_copy(update={"extra_fields": {
            **sample.extra_fields, AGENT: sample.extra_fields.get(AGENT) or self.name,
            **steps.as_fields()}})
        if (not sample.masked and scores is not None and agent.scoring.fixed is not False
                and (sample.reward is not None) != scores):  # (false: dropped, as documented)
            sample = self._disagreeing(sample, scores)
        pad = agent.pipeline.pad_token_id
        try:
            fields = to_verl_outputs([sample], items=None if item is None else [item],
                                     pad_token_id=pad, use_verl=False)[0]
        except Exception as exc:  # a contract error of the stage list's sample: mask it
            error = f"building the verl output failed: {type(exc).__name__}: {exc}"
            _logger.error("verl_output_failed", agent=self.name, uid=sample.uid, error=error)
            sample = minimal_sample(item, pad, error) if item is not None else sample
            sample = sample.model_copy(update={"extra_fields": {
                AGENT: self.name, **steps.as_fields()}})
            fields = to_verl_outputs([sample], pad_token_id=pad, use_verl=False)[0]
        extra = dict(fields["extra_fields"])
        extra.pop("reward_extra_info", None)
        if fields["response_logprobs"] is None:  # all-or-none across verl's worker
            fields["response_logprobs"] = [0.0] * len(fields["response_ids"])
        if scores:
            fields["reward_score"] = (0.0 if sample.masked or sample.reward is None
                                      else float(sample.reward))
            extra["reward_extra_info"] = reward_extra_info([sample], agent.reward_extra_keys)[0]
        else:
            fields["reward_score"] = None
        fields["extra_fields"] = extra
        module = import_verl("verl.experimental.agent_loop.agent_loop")
        metrics = module.AgentLoopMetrics(**fields.pop("metrics"))
        return module.AgentLoopOutput(**fields, metrics=metrics)


    def _disagreeing(self, sample: RolloutSample, scores: bool) -> RolloutSample:
        """A sample that disagrees with its entry on scoring, masked with an error that says
        so (verl needs every sample of a worker scored, or none)."""
        fixed = self.agent.scoring.fixed
        why = ("option judges: true" if fixed else "its other samples carry rewards") if scores \
            else "its other samples carry none"
        error = (f"verl agent loop {self.name!r}: the sample "
                 f"{'has no reward' if scores else 'carries a reward'} but the entry "
                 f"{'scores' if scores else 'does not score'} samples ({why}); every sample "
                 "of a verl worker needs a score, or none does: score every sample, or set "
                 "the entry's 'judges' option")
        _logger.error("verl_reward_disagrees", agent=self.name, uid=sample.uid, error=error)
        return sample.model_copy(update={
            "masked": True, "status": Status.FAILED, "finish_reason": FinishReason.ERROR,
            "reward": None, "error": error, "exit_reason": "error"})


def _carries_reward(sample: RolloutSample, item: AgentRolloutItem | None) -> bool:
    """Whether the stage list scored the sample (a masked sample's reward is only in its
    artifacts: the trainer view drops it)."""
    if sample.reward is not None:
        return True
    return item is not None and item.artifacts.get(A.REWARD) is not None


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


async def _run_one(pipeline: Pipeline, item: AgentRolloutItem) -> RolloutSample:
    """One sample through the pipeline, like ``run_batch`` without its per-batch log line
    (verl runs thousands of one-sample "batches")."""
    producer = pipeline.producer(None, None)
    runs = producer.start([item])
    async with pipeline.batch_scope(1):
        try:
            await producer.wait_all()
        except BaseException:
            await producer.cancel()
            raise
    return pipeline.sample_of(runs[0])


def _unreadable(item: AgentRolloutItem | None, kwargs: Mapping[str, Any], pad: int,
                error: str) -> RolloutSample:
    """A fully masked sample for a row that never became an item."""
    if item is None:
        group = str(kwargs.get("uid", os.urandom(8).hex()))
        return RolloutSample(
            uid=f"{group}-{kwargs.get('session_id', 0)}", group_id=group, index=0,
            prompt_ids=[pad], response_ids=[pad], response_mask=[0], logprobs=[0.0],
            reward=None, reward_payload={}, status=Status.FAILED,
            finish_reason="error", raw_finish_reason=None, masked=True, exit_reason="error",
            error=error, policy_version=None, routed_experts=None, tool_turns=0,
            extra_fields={})
    return minimal_sample(item, pad, error)


def _build(where: str, options: dict[str, Any], verl_args: dict[str, Any]) -> _Agent:
    made = make_stages(options["factory"], options.get("factory_kwargs"), where)
    if isinstance(made, Pipeline):
        stages, resources, config, fill = made.stages, made.resources, made.config, made.fill
    else:
        stages, resources, config, fill = made, Resources(), PipelineConfig(), fill_sample
    rollout = verl_args["trainer_config"].config.actor_rollout_ref.rollout
    prompt_length, response_length = int(rollout.prompt_length), int(rollout.response_length)
    tokenizer = verl_args["tokenizer"]
    eos = getattr(tokenizer, "eos_token_id", None)
    engine = VerlServerEngine(
        verl_args["server_manager"], eos_token_ids=[eos] if isinstance(eos, int) else [],
        max_model_len=int(rollout.get("max_model_len") or prompt_length + response_length),
        base_params={"repetition_penalty": 1.0})
    overrides: dict[str, Any] = {"progress_log_s": None}
    # verl's own agent loops render with ``data.apply_chat_template_kwargs`` (e.g.
    # enable_thinking): ours do too, under the factory's own options.
    data_get = getattr(getattr(verl_args["trainer_config"].config, "data", None), "get", None)
    verl_options = data_get("apply_chat_template_kwargs") if callable(data_get) else None
    if verl_options:
        overrides["chat_template_kwargs"] = {**dict(verl_options),
                                             **config.chat_template_kwargs}
    for field in ("sample_timeout_s", "max_concurrency"):
        if field in options:
            overrides[field] = options[field]
    if options.get("sampling"):
        overrides["sampling"] = config.sampling.with_overrides(
            options["sampling"], where=f"{where}: option 'sampling'")
    try:
        pipeline = Pipeline(stages, resources=dataclasses.replace(
            resources, engine=engine, tokenizer=tokenizer),
            config=merge_config(config, overrides), fill=fill)
    except Exception as exc:
        raise ConfigError(f"{where}: the factory's stage list or options are invalid: "
                          f"{type(exc).__name__}: {exc}") from exc
    judges = options.get("judges")
    if judges is not None and not isinstance(judges, bool):
        raise ConfigError(f"{where}: option 'judges' must be true, false or absent, got "
                          f"{judges!r:.80}", field="judges")
    keys = options.get("reward_extra_keys") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{where}: option 'reward_extra_keys' must be a list of strings, "
                          f"got {keys!r:.80}", field="reward_extra_keys")
    return _Agent(pipeline=pipeline, engine=engine, scoring=Scoring(judges),
                  route_names=_route_names(pipeline.stages), reward_extra_keys=keys,
                  prompt_length=prompt_length, response_length=response_length)
