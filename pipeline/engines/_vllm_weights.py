"""The in-process vLLM engine's weights: pause and resume, in-place updates, the prefix cache,
and loading the current weights into an engine restarted after its core died.

A part of :class:`~pipeline.engines.vllm.VLLMEngine` (its base class), apart because weight sync is
its own concern: the engine's generation and restart code ask only ``policy_version`` and the
last update's source.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from pipeline._exceptions import EngineError
from pipeline.engines._vllm_compat import Features, absolute, as_engine_error
from pipeline.engines._vllm_restart import CoreWatch
from pipeline.engines._weight_sync import (
    PauseMode,
    check_pause_mode,
    check_weight_source,
    next_version,
)

_logger = structlog.get_logger("pipeline.engines.vllm")


class VLLMWeights:
    """Weight sync of :class:`~pipeline.engines.vllm.VLLMEngine` (see its class doc)."""

    llm: Any
    policy_version: int | None
    features: Features
    watch: CoreWatch
    _paused: bool
    _versions: dict[str, int | None]
    _staged: Path | None
    _loaded: tuple[str, int | None] | None
    _start_version: int | None

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Pause vLLM's scheduler; requests in flight are aborted, awaited or kept."""
        mode = check_pause_mode(mode)
        await self.watch.ready()
        self._paused = True
        with as_engine_error("pausing"):
            await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        """Resume vLLM's scheduler; requests submitted while paused take the version loaded
        now."""
        for request_id, version in self._versions.items():
            if version is None:
                self._versions[request_id] = self.policy_version
        self._paused = False
        await self.watch.ready()
        with as_engine_error("resuming"):
            await self.llm.resume_generation()

    async def update_weights(self, state_dict: Mapping[str, Any] | None = None,
                             path: str | Path | None = None, *,
                             version: int | None = None) -> int:
        """Reload the weights in place, drop the prefix cache, bump ``policy_version``.

        Args:
            state_dict: name -> tensor in the checkpoint's (Hugging Face) naming; staged as
                safetensors and read by the workers (fine for small models; see the class
                doc).
            path: a model directory with safetensors files of the same architecture.
            version: the new version (default: the current one plus 1).

        Returns:
            The new policy version.

        Raises:
            ConfigError: both or neither source given.
            EngineError: vLLM could not load the weights.
        """
        check_weight_source(state_dict, path)
        source = "path" if path is not None else "state_dict"
        await self.watch.ready()
        staged = None
        if state_dict is not None:
            path = staged = await asyncio.to_thread(stage_state_dict, state_dict)
        assert path is not None
        try:
            with as_engine_error("loading the new weights"):
                await self.llm.collective_rpc("reload_weights",
                                              kwargs={"weights_path": absolute(path)})
        except BaseException:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
            raise
        if staged is not None:  # the previous update's copy is no longer what a restart loads
            self._drop_staged()
            self._staged = staged
        if self._paused and self._versions:
            # Requests kept by pause("keep") hold KV the old weights computed: preempted now,
            # they prefill their prompt and sampled tokens again under the new weights on
            # resume (tokens kept, none re-sampled), a partial rollout.
            with as_engine_error("recomputing the kept requests"):
                await self.llm.reset_prefix_cache(reset_running_requests=True)
        await self.reset_prefix_cache()
        new = next_version(self.policy_version, version)
        if self.features.weight_versions:  # vLLM stamps its outputs' token spans itself
            with as_engine_error("setting the weight version"):
                await self.llm.update_weight_version(str(new))
        self.policy_version = new
        self._loaded = (absolute(path), new)
        _logger.info("weights_updated", policy_version=new, source=source)
        return new

    def _drop_staged(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    async def reset_prefix_cache(self) -> bool:
        """Drop vLLM's prefix cache (False while running requests still hold blocks)."""
        await self.watch.ready()
        with as_engine_error("resetting the prefix cache"):
            return bool(await self.llm.reset_prefix_cache())

    async def _restore(self, llm: Any) -> None:
        """Load the weights of :attr:`policy_version` into the new ``llm`` and check it."""
        version = self.policy_version
        source, loaded = self._loaded or (None, self._start_version)
        if loaded != version:
            raise EngineError(f"policy version {version} was not loaded through "
                              f"update_weights (the last update loaded {loaded}), so the "
                              f"restart cannot load those weights again")
        if source is not None:
            with as_engine_error("loading the current weights into the restarted engine"):
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": source})
            if Features.detect(llm).weight_versions:
                with as_engine_error("setting the weight version"):
                    await llm.update_weight_version(str(version))
            read = getattr(llm, "get_weight_version", None)  # vLLM 0.32 reads it back
            if callable(read):
                with as_engine_error("reading the weight version"):
                    reported = await read()
                if reported != str(version):
                    raise EngineError(f"the restarted engine reports weight version "
                                      f"{reported!r}, not {version}")
        if self._paused:  # the trainer paused the dead one; it resumes the new one
            with as_engine_error("pausing the restarted engine"):
                await llm.pause_generation(mode="keep", clear_cache=False)


def stage_state_dict(state_dict: Mapping[str, Any]) -> Path:
    """Write ``state_dict`` as safetensors into a fresh staging directory (in shared memory
    where it has room) and return it. vLLM's RPC carries no tensors, and a checkpoint
    directory is what its in-place reload reads; the engine keeps the latest one for a
    restart."""
    from safetensors.torch import save_file

    size = sum(v.numel() * v.element_size() for v in state_dict.values())
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size else None
    directory = Path(tempfile.mkdtemp(prefix="pipeline-weights-", dir=root))
    tensors = {name: value.detach().to("cpu").contiguous().clone()
               for name, value in state_dict.items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
