"""The :class:`Pipeline`: batches and streams of samples over a stage list, each sample run by
:class:`~pipeline._runner.sample_runner.SampleRunner` (the one place where stage errors,
timeouts and aborts become a status)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import structlog

from pipeline._concurrency.callables import check_callable
from pipeline._concurrency.cancel import stage_grace
from pipeline._data.config import PipelineConfig, merge_config
from pipeline._data.items import make_items
from pipeline._data.models import AgentRolloutItem, ProduceBatchResult, RolloutSample
from pipeline._data.rows import DatasetRow
from pipeline._data.stats import safe_stats
from pipeline._exceptions import ConfigError
from pipeline._logging import log_batch_done
from pipeline._runner.context import Context, Resources, Stage
from pipeline._runner.contracts import check_chain
from pipeline._runner.dynamic import DynamicSampling, GroupResult, StreamReport
from pipeline._runner.fill import SampleBuilder, fill_sample
from pipeline._runner.heartbeat import ProgressHeartbeat
from pipeline._runner.host import InflightSample
from pipeline._runner.loop_state import LoopState
from pipeline._runner.producer import Producer, SampleCallback, check_callback
from pipeline._runner.sample_runner import SampleRunner
from pipeline._runner.stage import as_stages, check_stage_budgets
from pipeline._runner.stream import (
    RolloutStream,
    RowSource,
    SampleResult,
    check_num_needed,
    stream_groups,
    stream_samples,
)

_logger = structlog.get_logger("pipeline")



_RUNNING: weakref.WeakSet[Pipeline] = weakref.WeakSet()

_ENTERED: contextvars.ContextVar[tuple[Pipeline, ...]] = contextvars.ContextVar(
    "pipeline_entered", default=())
"""The pipelines whose samples the current code runs in (outermost first): set in the
context each sample's task starts from, inherited by the tasks and threads its stages start."""


def running_pipelines() -> list[Pipeline]:
    """Pipelines with a batch in progress in this process (read by diagnostics only)."""
    return [p for p in list(_RUNNING) if p._active_batches]


class Pipeline(SampleRunner):
    """A list of stages run on every sample, with per-sample failure isolation.

    Args:
        stages: stages (objects with ``name`` and ``async run(item, ctx)``, or bare async
            functions ``f(item, ctx)``), run in order.
        resources: shared resources; or give ``engine``/``tokenizer``/``tools``/``judgers``/
            ``limiters``/``extras`` as keywords instead.
        config: a :class:`PipelineConfig`; keyword ``options`` (``sample_timeout_s=...``,
            ``max_concurrency=...``) override its fields.
        fill: builds the trainer view of a finished item (default :func:`fill_sample`).

    Raises:
        StageDefinitionError: something in ``stages`` is not a stage.
        ConfigError: an invalid option, naming the field.
    """

    def __init__(
        self,
        stages: Iterable[Any],
        *,
        resources: Resources | None = None,
        config: PipelineConfig | Mapping[str, Any] | None = None,
        fill: SampleBuilder = fill_sample,
        **options: Any,
    ) -> None:
        resource_keys = {"engine", "tokenizer", "tools", "judgers", "limiters", "extras"}
        given = {k: options.pop(k) for k in list(options) if k in resource_keys}
        if resources is not None and given:
            raise ConfigError(f"pass either resources= or {sorted(given)}, not both")
        if resources is not None and not isinstance(resources, Resources):
            raise ConfigError(f"resources must be a Resources, got {type(resources).__name__}",
                              field="resources")
        self.stages: list[Stage] = as_stages(stages)
        check_chain(self.stages)  # stage contracts: a chain that cannot work fails here
        self.resources = resources or Resources(**given)
        self.config = merge_config(config, options)
        check_stage_budgets(self.stages, self.config.stage_timeout_s)
        check_callable(fill, "fill", "sync", shape="(item, ctx) -> RolloutSample")
        self.fill = fill
        # Slots are per event loop: a pipeline may serve a trainer's loop and a thread's loop.
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self._inflight: dict[str, Context] = {}
        self._active_batches = 0
        self._lock = threading.Lock()  # counters: one pipeline may serve several loops
        self.samples_done = 0
        self.last_sample_done = None

    def make_items(self, rows: Iterable[Any], n: int | None = None) -> list[AgentRolloutItem]:
        """Validate rows and expand each to ``n`` items sharing a ``group_id``.

        Rows may be dicts (our schema or verl's), :class:`DatasetRow` or ready
        :class:`AgentRolloutItem` objects (taken as they are). ``n`` defaults to the row's
        ``sampling.n``. Each item gets its own seed.

        A stage with a ``check_row(row, index)`` method (``Route`` has one) checks every row
        here too, so a row it cannot run is refused before any work starts.

        Raises:
            RowError: a malformed row, naming the row and field.
            ConfigError: invalid ``n`` or sampling overrides.
        """
        return self.check_rows(make_items(rows, n, self.config))

    def check_rows(self, items: list[AgentRolloutItem]) -> list[AgentRolloutItem]:
        """Run the stages' ``check_row(row, index)`` hooks once per row of ``items``."""
        checks = [check for stage in self.stages
                  if callable(check := getattr(stage, "check_row", None))]
        if checks:
            rows = {id(item.data): item.data for item in items}
            for index, row in enumerate(rows.values()):
                for check in checks:
                    check(row, index)
        return items

    async def run(
        self, item_or_row: AgentRolloutItem | DatasetRow | Mapping[str, Any]
    ) -> RolloutSample:
        """Run one sample; a passed item is updated in place. Never raises for stage errors."""
        result = await self.run_batch([item_or_row], n=1)
        return result.samples[0]

    async def run_batch(
        self,
        rows: Iterable[Any],
        *,
        n: int | None = None,
        num_needed: int | None = None,
        on_sample_done: SampleCallback | None = None,
    ) -> ProduceBatchResult:
        """Run every sample of a batch; one :class:`RolloutSample` per sample, in input order.

        Args:
            rows: dicts, :class:`DatasetRow` or :class:`AgentRolloutItem` objects.
            n: rollouts per prompt (default: ``sampling.n``).
            num_needed: over-sampling: once this many samples completed, abort the rest
                (they end ``status=aborted``; their engine requests are aborted).
            on_sample_done: called with ``(item, sample)`` as each sample ends.

        Raises:
            RowError, ConfigError: bad input, before any work starts.
            asyncio.CancelledError: the call was cancelled; every sample task is cancelled
                and awaited first (stage cleanups run), none is left behind.
        """
        self._refuse_reentry("run_batch")
        check_callback(on_sample_done)
        items = self.make_items(rows, n)
        check_num_needed(num_needed, len(items))
        started = time.monotonic()
        producer = self.producer(num_needed, on_sample_done)
        runs = producer.start(items)
        async with self.batch_scope(len(items)):
            try:
                await producer.wait_all()
            except BaseException:
                await producer.cancel()
                raise
        samples = [self.sample_of(run) for run in runs]
        stats = safe_stats(samples, items, time.monotonic() - started)
        log_batch_done(_logger, stats, items)
        result = ProduceBatchResult(samples=samples, items=items, stats=stats)
        breaker = self._loop_state().flow.breaker
        if breaker.opened:
            raise breaker.error(result)
        return result

    def stream(
        self,
        rows: Iterable[Any],
        *,
        n: int | None = None,
        num_needed: int | None = None,
        on_sample_done: SampleCallback | None = None,
    ) -> RolloutStream[SampleResult]:
        """Yield each sample as it finishes, as ``(sample, item)``; same guarantees as
        :meth:`run_batch` (every sample exactly once, statuses, cleanups).

        Use it as ``async with pipeline.stream(rows, n=4) as samples: async for sample, item
        in samples: ...``: leaving the block early (``break``, an error, a cancellation)
        cancels the samples still running, runs their cleanups and waits for them; so does
        ``aclose()``, from any task. The stream's ``report`` (:class:`StreamReport`) counts
        every sample started, yielded or not.

        Raises:
            RowError, ConfigError: bad input, before any work starts.
        """
        self._refuse_reentry("stream")
        check_callback(on_sample_done)
        items = self.make_items(rows, n)
        check_num_needed(num_needed, len(items))
        report = StreamReport()
        return RolloutStream(stream_samples(self, items, num_needed, on_sample_done, report),
                             report)

    def stream_groups(
        self,
        rows: Iterable[Any],
        *,
        n: int | None = None,
        num_needed: int | None = None,
        dynamic: DynamicSampling | None = None,
        on_sample_done: SampleCallback | None = None,
    ) -> RolloutStream[GroupResult]:
        """Yield each prompt's group once all ``n`` of its samples have finished.

        With ``dynamic`` (:class:`DynamicSampling`), groups its ``keep`` rule rejects (by
        default: every reward equal, no learning signal for GRPO) are not yielded but
        reported in the stream's ``report``, and new prompts are drawn from ``rows`` (any
        iterable, read lazily) until ``target_groups`` groups were kept or a cap is hit.
        The stream's ``report`` (:class:`StreamReport`) accounts for every group and sample
        started, however the stream ends.

        Raises:
            RowError, ConfigError: bad input (rows drawn later are checked when drawn).
        """
        self._refuse_reentry("stream_groups")
        if dynamic is not None and not isinstance(dynamic, DynamicSampling):
            raise ConfigError(f"field 'dynamic': must be a DynamicSampling, got {dynamic!r}")
        if dynamic is not None and num_needed is not None:
            raise ConfigError("pass either num_needed= (over-sampling by samples) or dynamic= "
                              "(by informative groups), not both")
        check_callback(on_sample_done)
        source = RowSource(rows, n, self, None if dynamic is None else dynamic.max_samples)
        first = source.first_wave(dynamic)
        check_num_needed(num_needed, len(first))
        report = StreamReport()
        return RolloutStream(stream_groups(self, source, first, num_needed, dynamic,
                                           on_sample_done, report), report)

    def _refuse_reentry(self, call: str) -> None:
        """A batch started from inside one of this pipeline's own samples would wait for the
        concurrency slots its callers hold (forever, once they hold them all): refused."""
        if self in _ENTERED.get():
            raise ConfigError(
                f"Pipeline.{call} was called from inside a stage of the same Pipeline: its "
                "samples would wait for the concurrency slots the calling samples hold. Run "
                "nested batches on a second Pipeline (it may share this one's resources: "
                "Pipeline(stages, resources=pipeline.resources))", field="stages")

    def producer(self, num_needed: int | None, on_done: SampleCallback | None) -> Producer:
        """A :class:`Producer` whose tasks run this pipeline's samples (for streams)."""
        return Producer(lambda run, batch: self._run_sample(run, batch, on_done), num_needed,
                        lambda run, batch, status, error: self._give_up(run, batch, status,
                                                                        error, on_done),
                        stage_grace(self.config.cleanup_timeout_s), self._enter)

    def _enter(self) -> None:
        """Mark the context the samples' tasks start from (see :meth:`_refuse_reentry`)."""
        _ENTERED.set((*_ENTERED.get(), self))

    @contextlib.asynccontextmanager
    async def batch_scope(self, total: int | None) -> AsyncIterator[None]:
        """Marks a batch in progress (diagnostics) and logs its heartbeat, if configured."""
        _RUNNING.add(self)
        with self._lock:
            self._active_batches += 1
        try:
            async with self._loop_state().flow.running(self.resources.engine):
                if self.config.progress_log_s is None:
                    yield
                else:
                    async with ProgressHeartbeat(self, interval_s=self.config.progress_log_s,
                                                 total=total):
                        yield
        finally:
            with self._lock:
                self._active_batches -= 1

    def flow_state(self) -> dict[str, Any] | None:
        """Flow control as plain data: the concurrency limit, samples admitted, and the
        adaptive controller's and circuit breaker's state when on (of the loop this
        pipeline ran on last); None before any sample ran. Safe from any thread."""
        states = list(self._loops.values())
        return states[-1].flow.state() if states else None

    def inflight(self) -> list[InflightSample]:
        """The samples running now, with their current stage and how long they have run."""
        now = time.monotonic()
        return [
            InflightSample(
                uid=ctx.item.uid,
                group_id=ctx.item.group_id,
                stage=ctx.stage,
                turn=ctx.turn,
                running_s=now - (ctx.item.started_at or now),
                in_stage_s=None if ctx.stage_started is None else now - ctx.stage_started,
            )
            for ctx in list(self._inflight.values())
        ]
