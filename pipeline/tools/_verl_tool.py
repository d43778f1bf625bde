"""verl's ``BaseTool`` as a per-trajectory tool of this project's tool loop.

A verl tool (a ``verl.tools.base_tool.BaseTool`` subclass, or anything with its methods) has
``get_openai_tool_schema()``, ``create(instance_id=None, **kwargs) -> (instance_id, response)``,
``execute(instance_id, parameters) -> (ToolResponse, reward, metrics)`` and
``release(instance_id)``. :class:`VerlTool` makes it a :class:`~pipeline.tools.TrajectoryTool`:
one instance per trajectory, created at the sample's first call with the row's
``tools_kwargs[<name>]["create_kwargs"]`` (verl's dataset field), released once when the sample
ends on every outcome; each call's reward goes to ``extra_fields["tool_rewards"]``. verl
itself is not imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline._exceptions import ConfigError
from pipeline.tools._lifecycle import ToolResult


class VerlTool:
    """A verl ``BaseTool`` with one instance per trajectory (see the module doc).

    (verl 0.9.1's own ``ToolAgentLoop`` creates and releases an instance around every call;
    ``BaseTool``'s docstring describes an instance per trajectory, which is what this does, so
    a tool's state lasts across the calls of one sample.)

    Args:
        tool: the verl tool instance.
        timeout_s: one call's limit (creating the instance counts towards the first call).
        rate: sustained calls per second (None: unlimited), as ``FunctionTool``.
        burst: calls allowed at once above ``rate``.
        max_concurrency: calls running at once (None: unlimited).
        fairness_key: what the limit is shared fairly across, as ``FunctionTool``.

    Raises:
        ConfigError: ``tool`` lacks a verl tool's methods or its schema has no function name.
    """

    def __init__(self, tool: Any, *, timeout_s: float = 30.0, rate: float | None = None,
                 burst: int | None = None, max_concurrency: int | None = None,
                 fairness_key: str | None = None) -> None:
        missing = [m for m in ("get_openai_tool_schema", "create", "execute", "release")
                   if not callable(getattr(tool, m, None))]
        if missing:
            raise ConfigError(f"VerlTool: {type(tool).__name__} is not a verl tool: it lacks "
                              f"{', '.join(missing)}", field="tool")
        schema = tool.get_openai_tool_schema()
        dumped = schema.model_dump(exclude_none=True) if hasattr(schema, "model_dump") else schema
        function = dict(dumped.get("function") or {})
        if not function.get("name"):
            raise ConfigError("VerlTool: the tool's schema has no function name", field="tool")
        self.tool = tool
        self.name: str = function["name"]
        self.description: str = function.get("description", "")
        self.parameters: Mapping[str, Any] = function.get(
            "parameters", {"type": "object", "properties": {}})
        self.timeout_s = timeout_s
        self.rate, self.burst, self.max_concurrency = rate, burst, max_concurrency
        self.fairness_key = fairness_key

    async def __call__(self, arguments: Mapping[str, Any]) -> Any:
        """Refused: a verl tool's instance is created by CallTools, per trajectory."""
        raise RuntimeError(f"tool {self.name!r} needs a per-trajectory instance: it runs "
                           "through CallTools")

    async def create_for(self, item: Any) -> tuple[Any, bool]:
        """``tool.create(create_kwargs=...)`` with the row's ``tools_kwargs`` for this tool."""
        tools_kwargs = item.data.extra.get("tools_kwargs") or {}
        kwargs = tools_kwargs.get(self.name, {}) if isinstance(tools_kwargs, Mapping) else {}
        instance_id, _ = await self.tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        return instance_id, False

    async def call_with(self, resource: Any, arguments: Mapping[str, Any]) -> Any:
        """``tool.execute``: its text for the model, its reward for ``tool_rewards``."""
        response, reward, _metrics = await self.tool.execute(resource, dict(arguments))
        text = getattr(response, "text", response)
        return ToolResult("" if text is None else text,
                          reward=None if reward is None else float(reward))

    async def release_resource(self, resource: Any) -> None:
        """``tool.release(instance_id)``."""
        await self.tool.release(resource)
