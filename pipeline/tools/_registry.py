"""What a tool is, and the registry (a plain ``dict`` name -> tool) the pipeline holds.

A tool is anything with ``name``, ``description``, ``parameters`` (a JSON schema),
``timeout_s`` and ``async __call__(arguments)``; :class:`FunctionTool` wraps an async function.
The optional rate-limit fields (``rate``, ``burst``, ``max_concurrency``, ``fairness_key``) are
declared here and read by the tool-calling stage where it acquires before calling.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline._concurrency.callables import check_callable, is_async_callable
from pipeline._exceptions import ConfigError


@runtime_checkable
class Tool(Protocol):
    """A callable tool as the tool-calling stage sees it."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    timeout_s: float

    async def __call__(self, arguments: Mapping[str, Any]) -> Any:
        """Run the tool on already validated arguments; the result is sent back as text
        (``str`` as is, anything else as JSON)."""
        ...


FAIRNESS_KEYS = (None, "group_id", "uid", "data_source")
"""What a tool's rate limit may be shared fairly across (None: first come, first served)."""


@dataclass(frozen=True, kw_only=True)
class FunctionTool:
    """A tool backed by an ``async def fn(**arguments)``.

    Attributes:
        name: what the model calls it.
        description: shown to the model with the schema.
        parameters: JSON schema of the arguments object.
        fn: the implementation, called with the arguments as keywords and awaited: an
            ``async def`` function, a ``functools.partial`` of one, or an object whose
            ``__call__`` is ``async def`` (a plain function is refused).
        timeout_s: a call that takes longer ends with a timeout error for the model.
        rate: sustained calls per second allowed (None: unlimited).
        burst: calls allowed at once above ``rate``.
        max_concurrency: calls running at once (None: unlimited).
        fairness_key: which sample attribute shares the limit fairly (``"group_id"``,
            ``"uid"``, ``"data_source"``); None shares it first come, first served.
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}})
    fn: Callable[..., Awaitable[Any]]
    timeout_s: float = 10.0
    rate: float | None = None
    burst: int | None = None
    max_concurrency: int | None = None
    fairness_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tool name must be a non-empty string, got {self.name!r}",
                              field="name")
        check_callable(self.fn, "fn", "async", owner=f"tool {self.name!r}",
                       shape="(**arguments)")
        if not isinstance(self.parameters, Mapping):
            raise ConfigError(f"tool {self.name!r}: parameters must be a JSON schema (a dict)",
                              field="parameters")
        for name in ("timeout_s", "rate", "burst", "max_concurrency"):
            value = getattr(self, name)
            if value is None and name != "timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"tool {self.name!r}: {name} must be a number > 0, got "
                                  f"{value!r}", field=name)
        if self.fairness_key not in FAIRNESS_KEYS:
            raise ConfigError(f"tool {self.name!r}: fairness_key must be one of "
                              f"{FAIRNESS_KEYS}, got {self.fairness_key!r}", field="fairness_key")

    async def __call__(self, arguments: Mapping[str, Any]) -> Any:
        """Call ``fn(**arguments)``."""
        return await self.fn(**arguments)


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI tool schema of ``tool`` (what a row's ``tools`` list holds)."""
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}}


def make_registry(tools: Iterable[Tool]) -> dict[str, Tool]:
    """Build the registry for ``Pipeline(tools=...)`` from tools, checking names.

    Raises:
        ConfigError: a tool lacks the protocol's members or its ``__call__`` is not async,
            or two tools share a name.
    """
    registry: dict[str, Tool] = {}
    for tool in tools:
        if not isinstance(tool, Tool):
            raise ConfigError(f"{tool!r} is not a tool: it needs name, description, "
                              "parameters, timeout_s and 'async __call__(arguments)'")
        if not is_async_callable(tool):
            raise ConfigError(f"tool {tool.name!r} ({type(tool).__name__}): its __call__ "
                              "must be 'async def __call__(arguments)'", field=tool.name)
        if tool.name in registry:
            raise ConfigError(f"two tools are named {tool.name!r}")
        registry[tool.name] = tool
    return registry
