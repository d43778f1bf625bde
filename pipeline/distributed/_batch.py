"""One batch (or stream) on the fleet: the worker calls it makes, their results, retries.

Rules a batch keeps on every path:

- Only a lost worker retries samples: those it had not returned run again once on another
  worker (``max_retries``), then end ``failed`` naming it.
- Any other error of a worker call (Ray could not send the batch, a worker method raised)
  ends that call's unreturned samples ``failed`` with the real cause, once the worker has
  answered a health check; a worker that does not is lost instead.
- Load: a call raises its worker's load by its samples inside the ``try`` whose ``finally``
  lowers it by every sample that did not come back, so no path leaves load behind.
- A sample still running when the pool closes ends ``aborted``.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import ray
import structlog

from pipeline._data.models import AgentRolloutItem, Status
from pipeline._runner.context import Context, Resources
from pipeline._runner.fill import fill_sample, minimal_sample
from pipeline._runner.outcome import ENOUGH, force_end
from pipeline._runner.stream import SampleResult
from pipeline.distributed._errors import CLOSED_WHILE_RUNNING, describe, is_worker_loss
from pipeline.distributed._fleet import Fleet, SlotWorker
from pipeline.distributed._merge import by_group
from pipeline.distributed._packing import Chunk
from pipeline.distributed._worker import WorkerBroken

_logger = structlog.get_logger("pipeline.distributed")


class BatchRun:
    """One batch (or stream) on the fleet: the worker calls it made, their results, retries."""

    def __init__(self, fleet: Fleet, num_needed: int | None, max_retries: int) -> None:
        self.fleet = fleet
        self.num_needed = num_needed
        self.max_retries = max_retries
        self.completed = 0
        self.aborting = False
        self.results: asyncio.Queue[list[SampleResult]] = asyncio.Queue()
        self.calls: dict[str, SlotWorker] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.tries: dict[str, list[str]] = {}  # group id -> workers that lost it

    def send_all(self, shards: list[tuple[SlotWorker, list[AgentRolloutItem]]]) -> None:
        """One worker call per shard (a method of its own: a loop in the caller's frame
        would keep the last shard's items for the whole batch)."""
        for worker, items in shards:
            self.send(worker, items)

    def send(self, worker: SlotWorker, items: list[AgentRolloutItem]) -> None:
        call = self.fleet.call_id()
        self.calls[call] = worker
        task = asyncio.get_running_loop().create_task(self._consume(call, worker, items),
                                                      name=f"ray-call:{worker.worker_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _consume(self, call: str, worker: SlotWorker,
                       items: list[AgentRolloutItem]) -> None:
        pending = {item.uid: item for item in items}
        error: Exception | None = None
        worker.load += len(items)  # lowered in the finally by whatever did not come back
        try:
            try:
                stream = worker.handle.run_items.options(num_returns="streaming").remote(
                    call, items)
            except Exception as exc:  # Ray could not send them: fail those that cannot go
                unsendable = _unsendable(items)
                if not unsendable:
                    raise
                for uid, why in unsendable.items():
                    self._end([pending.pop(uid)], Status.FAILED,
                              f"Ray could not send this sample to {worker.name()}: {why}")
                worker.load -= len(unsendable)
                _logger.error("ray_send_failed", worker=worker.worker_id,
                              samples=len(unsendable), error=describe(exc, first_line=True,
                                                                       limit=300))
                if pending:  # the others go on their own (a new call counts them again)
                    resend = list(pending.values())
                    pending.clear()
                    worker.load -= len(resend)
                    self.send(worker, resend)
                return
            del items  # from here each is kept in pending until its sample is back
            if self.aborting:  # the worker remembers an abort that comes before its batch
                worker.handle.abort.remote(call)
            async for ref in stream:
                self._deliver(worker, await ref, pending)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc
        finally:
            self.calls.pop(call, None)
            worker.load -= len(pending)
        if pending:
            await self._settle(worker, list(pending.values()), error)

    def _deliver(self, worker: SlotWorker, chunk: Chunk,
                 pending: dict[str, AgentRolloutItem]) -> None:
        """Hand a chunk's samples to the consumer (not in _consume's loop: its locals would
        keep the last chunk's samples while it waits for the next, after the consumer may
        have taken and dropped them)."""
        results = [r for entry in chunk
                   if (r := self._unpack(worker, entry, pending)) is not None]
        worker.load -= len(results)
        for result in results:
            if result.sample.status is Status.COMPLETED:
                self.completed += 1
        self.results.put_nowait(results)
        self._check_enough()

    def _unpack(self, worker: SlotWorker, entry: Any, pending: dict[str, AgentRolloutItem]
                ) -> SampleResult | None:
        uid, payload, error = entry
        item = pending.pop(uid, None)
        if item is None:
            return None  # not ours (already ended): never twice
        if payload is None:
            return self.end_locally(item, Status.FAILED, str(error))
        try:
            sample, returned = pickle.loads(payload)
        except KeyboardInterrupt:
            raise  # the driver's own Ctrl-C
        except BaseException as exc:  # a __reduce__ of the user's may raise anything
            return self.end_locally(
                item, Status.FAILED, f"the sample came back from {worker.name()} but could "
                f"not be unpickled on the driver: {describe(exc)}")
        return SampleResult(sample, returned)

    async def _settle(self, worker: SlotWorker, items: list[AgentRolloutItem],
                      error: Exception | None) -> None:
        """Samples a call did not return: a lost worker's are retried; any other error ends
        them ``failed`` with its real cause."""
        lost = error is None or is_worker_loss(error)
        if not lost and not await self.fleet.probe(worker):
            lost = True
        if self.fleet.closed:
            self._end(items, Status.ABORTED, CLOSED_WHILE_RUNNING)
            return
        if lost:
            cause = error or WorkerBroken("its stream ended before every sample came back")
            self.fleet.worker_lost(worker, cause)
            await self._retry(worker, items, cause)
            return
        assert error is not None
        _logger.error("ray_call_failed", worker=worker.worker_id, samples=len(items),
                      error=describe(error, limit=500))
        self._end(items, Status.FAILED,
                  f"{worker.name()} could not run it: {describe(error)}")

    def _check_enough(self) -> None:
        if (self.num_needed is not None and not self.aborting
                and self.completed >= self.num_needed):
            self.abort_all()

    def abort_all(self) -> None:
        self.aborting = True
        for call, worker in list(self.calls.items()):
            if not worker.lost:
                worker.handle.abort.remote(call)

    async def _retry(self, worker: SlotWorker, items: list[AgentRolloutItem],
                     error: BaseException) -> None:
        died = worker.name()
        reason = describe(error, first_line=True)
        groups = by_group(items)
        _logger.warning("ray_samples_lost", worker=worker.worker_id, samples=len(items),
                        groups=len(groups), error=reason)
        for gid, group in groups.items():
            tried = self.tries.setdefault(gid, [])
            tried.append(worker.worker_id)
            if self.aborting:
                self._end(group, Status.ABORTED, f"{ENOUGH} ({died} was lost before it ran)")
                continue
            target = None
            if len(tried) <= self.max_retries:
                target = await self.fleet.live_worker(set(tried))
            if self.fleet.closed:
                self._end(group, Status.ABORTED, CLOSED_WHILE_RUNNING)
                continue
            if target is None or self.aborting:
                self._end(group, Status.FAILED,
                          f"lost with {died}: {reason}; workers tried: {', '.join(tried)}")
                continue
            _logger.info("ray_samples_retried", group=gid, samples=len(group),
                         lost_on=worker.worker_id, retry_on=target.worker_id)
            self.send(target, group)

    def _end(self, items: list[AgentRolloutItem], status: Status, error: str) -> None:
        self.results.put_nowait([self.end_locally(item, status, error) for item in items])

    def end_locally(self, item: AgentRolloutItem, status: Status, error: str) -> SampleResult:
        """A sample the driver ends itself (its worker died, or it was aborted before it
        could run again): a masked trainer view built here."""
        force_end(item, status, error)
        config = self.fleet.config
        assert config is not None
        try:
            sample = fill_sample(item, Context(Resources(), config, item))
        except Exception:
            sample = minimal_sample(item, self.fleet.pad_token_id, error)
        return SampleResult(sample, item)

    async def next_results(self) -> list[SampleResult]:
        return await self.results.get()

    async def close(self) -> None:
        """Abort what still runs and wait for the workers to hand it back."""
        if self.tasks:
            self.abort_all()
            _, pending = await asyncio.wait(list(self.tasks), timeout=60)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def _unsendable(items: list[AgentRolloutItem]) -> dict[str, str]:
    """``uid -> why`` for the items that cannot be pickled on their own."""
    found = {}
    for item in items:
        try:
            ray.cloudpickle.dumps(item)
        except Exception as exc:
            found[item.uid] = describe(exc, first_line=True, limit=500)
    return found
