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
sample is an output whose response mask is all zero.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import weakref
from collections.abc import Mapping
from typing import Any

import structlog

from pipeline._config import PipelineConfig, merge_config
from pipeline._context import Resources
from pipeline._exceptions import ConfigError
from pipeline._fill import fill_sample, minimal_sample
from pipeline._models import AgentRolloutItem, RolloutSample, Status
from pipeline._pipeline import Pipeline
from pipeline._plain import plain
from pipeline.batch import reward_extra_info, to_verl_outputs
from pipeline.integrations.verl._engine import STEPS, StepRange, VerlServerEngine
from pipeline.integrations.verl._register import import_verl
from pipeline.stages import Judge, Loop, Route, Stage

_logger = structlog.get_logger("pipeline.integrations.verl")

OPTIONS = ("factory", "factory_kwargs", "sample_timeout_s", "max_concurrency", "sampling",
           "judges", "reward_extra_keys")
"""Options a YAML entry may set for :class:`PipelineAgentLoop` (besides ``name``/``_target_``)."""

_VERL_ARGS = ("trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls",
              "data_config", "hf_model_type", "tools")
"""What verl's worker passes every agent loop (``tools`` is verl's own tool list: unused)."""

AGENT = "agent"
"""``extra_fields`` key naming the YAML entry (verl's ``agent_name``) that ran the sample."""

_ROW_KEYS = ("tools_kwargs", "index", "data_source", "reward_model", "extra_info")


def resolve_factory(path: Any, where: str) -> Any:
    """The callable a dotted path (``pkg.module.make`` or ``pkg.module:make``) names.

    Raises:
        ConfigError: naming ``where`` (the YAML entry) and the module or attribute missing.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{where}: option 'factory' must be a dotted path "
                          f"('my_pkg.agents.make_stages'), got {path!r:.80}", field="factory")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: factory {path!r} is not 'module.attribute'",
                          field="factory")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: factory {path!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {exc})", field="factory") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{where}: factory {path!r}: {getattr(target, '__name__', target)!r}"
                              f" has no attribute {part!r}", field="factory")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{where}: factory {path!r} is a {type(target).__name__}, not "
                          "callable", field="factory")
    return target


def _judges(stages: list[Stage]) -> bool:
    """Whether a stage list holds a ``Judge`` (inside loops and routes too)."""
    for stage in stages:
        if isinstance(stage, Judge):
            return True
        if isinstance(stage, Loop) and _judges(stage.stages):
            return True
        if isinstance(stage, Route) and any(_judges(s) for s in stage.agents.values()):
            return True
    return False


@dataclasses.dataclass
class _Agent:
    """One YAML entry as built in one worker: the pipeline and what the output needs."""

    pipeline: Pipeline
    engine: VerlServerEngine
    judges: bool
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
        judges: whether the stage list scores samples (default: it holds a ``Judge``). If
            it does, every output has a ``reward_score`` (0.0 when masked); if not, every one
            has None and verl's reward loop scores them.
        reward_extra_keys: the reward payload's numeric leaves that become
            ``reward_extra_info`` (NaN where a sample lacks one). verl reads the keys of one
            sample on all others, so they are pinned; default: none.

    Raises:
        ConfigError: an unknown option, a factory that cannot be resolved or returns no
            valid stage list, naming the YAML entry.
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
        try:
            item = self._item(sampling_params, kwargs)
            token = STEPS.set(steps)
            try:
                sample = await _run_one(agent.pipeline, item)
            finally:
                STEPS.reset(token)
        except Exception as exc:  # a row verl gave us that we cannot read: still an output
            error = f"{type(exc).__name__}: {exc}"
            _logger.error("verl_sample_unreadable", agent=self.name, error=error)
            sample = _unreadable(item, kwargs, agent.pipeline.pad_token_id, error)
        if steps.min_global_steps is None:  # no reply from the server (failed, timed out):
            # the prompt's own step (V1 passes it; its trainer casts these tags to int)
            step = plain(kwargs.get("global_steps"))
            if isinstance(step, int):
                steps.min_global_steps = steps.max_global_steps = step
        return self._output(sample, item, steps)

    def _item(self, sampling_params: Mapping[str, Any], kwargs: Mapping[str, Any]
              ) -> AgentRolloutItem:
        verl_row = {k: plain(v) for k, v in kwargs.items()}
        row: dict[str, Any] = {"messages": verl_row.get("raw_prompt"),
                               "extra": {"verl": verl_row, AGENT: self.name}}
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
                steps: StepRange) -> Any:
        agent = self.agent
        sample = sample.model_copy(update={"extra_fields": {
            **sample.extra_fields, AGENT: self.name, **steps.as_fields()}})
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
        if agent.judges:
            fields["reward_score"] = (0.0 if sample.masked or sample.reward is None
                                      else float(sample.reward))
            extra["reward_extra_info"] = reward_extra_info([sample], agent.reward_extra_keys)[0]
        else:
            fields["reward_score"] = None
        fields["extra_fields"] = extra
        module = import_verl("verl.experimental.agent_loop.agent_loop")
        metrics = module.AgentLoopMetrics(**fields.pop("metrics"))
        return module.AgentLoopOutput(**fields, metrics=metrics)


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
    factory = resolve_factory(options["factory"], where)
    factory_kwargs = options.get("factory_kwargs") or {}
    if not isinstance(factory_kwargs, dict):
        raise ConfigError(f"{where}: option 'factory_kwargs' must be a mapping, got "
                          f"{factory_kwargs!r:.80}", field="factory_kwargs")
    try:
        made = factory(**factory_kwargs)
    except Exception as exc:
        raise ConfigError(f"{where}: factory {options['factory']!r} raised "
                          f"{type(exc).__name__}: {exc}", field="factory") from exc
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
    keys = options.get("reward_extra_keys") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{where}: option 'reward_extra_keys' must be a list of strings, "
                          f"got {keys!r:.80}", field="reward_extra_keys")
    return _Agent(pipeline=pipeline, engine=engine,
                  judges=_judges(pipeline.stages) if judges is None else bool(judges),
                  reward_extra_keys=keys, prompt_length=prompt_length,
                  response_length=response_length)
