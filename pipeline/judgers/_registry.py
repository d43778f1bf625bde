"""The judger registry: short names to judger factories, plus third-party entry points.

::

    @register_judger("my_judge")           # a class (or any callable returning a judger)
    class MyJudge: ...
    judge = get_judger("my_judge", **config)

Third-party packages register in their packaging metadata instead, under the
``pipeline.judgers`` entry-point group (``my_judge = "my_pkg.judgers:MyJudge"``); an entry
point is loaded only when its name is first asked for, so a broken plugin never breaks the
others. :class:`JudgerRegistry` instances are independent; the module-level functions use
the default one, which holds the built-in judgers.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from importlib import metadata
from typing import Any, TypeVar, overload

from pipeline._concurrency.callables import check_callable, is_async_callable, plain_result
from pipeline._exceptions import ContractError
from pipeline.judgers._base import Judger, JudgerRegistryError

ENTRY_POINT_GROUP = "pipeline.judgers"
"""The entry-point group third-party packages register judgers under."""

JudgerFactory = Callable[..., Any]
"""A judger class, or any callable that returns a judger when called with its config."""

F = TypeVar("F", bound=JudgerFactory)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class JudgerRegistry:
    """Maps judger names to factories; entry points of ``group`` are loaded on first use.

    Args:
        entry_point_group: where third-party judgers are found, or None to ignore plugins.
    """

    def __init__(self, *, entry_point_group: str | None = ENTRY_POINT_GROUP) -> None:
        self._factories: dict[str, JudgerFactory] = {}
        self._origins: dict[str, str] = {}
        self.entry_point_group = entry_point_group

    @overload
    def register(self, name: str, factory: None = None, *, replace: bool = False
                 ) -> Callable[[F], F]: ...

    @overload
    def register(self, name: str, factory: F, *, replace: bool = False) -> F: ...

    def register(self, name: str, factory: JudgerFactory | None = None, *,
                 replace: bool = False) -> Any:
        """Register ``factory`` under ``name``; without ``factory``, return a class decorator.

        Registering the very same factory again under the same name is a no-op (a plugin
        module that both decorates its class and names it in an entry point is fine).

        Raises:
            JudgerRegistryError: ``name`` is taken by another factory and ``replace`` is false,
                the name is malformed, or ``factory`` is not a plain callable (an
                ``async def`` factory is refused: ``create`` calls it synchronously).
        """
        if not isinstance(name, str) or not _NAME.match(name):
            raise JudgerRegistryError(
                f"judger name {name!r} is invalid: use letters, digits and '_.:-'")

        def decorate(obj: F) -> F:
            check_callable(obj, "factory", "sync", owner=f"judger {name!r}",
                           shape="(**config) -> judger", error=JudgerRegistryError)
            existing = self._factories.get(name)
            if existing is not None and existing is not obj and not replace:
                raise JudgerRegistryError(
                    f"judger {name!r} is already registered ({self._origins[name]}); pass "
                    f"replace=True to replace it")
            self._factories[name] = obj
            self._origins[name] = _describe(obj)
            return obj

        return decorate if factory is None else decorate(factory)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a no-op when it is not registered)."""
        self._factories.pop(name, None)
        self._origins.pop(name, None)

    def names(self) -> list[str]:
        """Every known name, sorted: registered ones and not-yet-loaded entry points."""
        return sorted({*self._factories, *self._entry_point_names()})

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def factory(self, name: str) -> JudgerFactory:
        """The factory registered as ``name``, loading its entry point on first use.

        Raises:
            JudgerRegistryError: the name is unknown (the message lists the known names), or
                its plugin fails to load (the message names the distribution and the target).
        """
        found = self._factories.get(name)
        if found is not None:
            return found
        if self.entry_point_group is not None:
            points = list(metadata.entry_points(group=self.entry_point_group, name=name))
            if len(points) > 1:
                owners = sorted(_dist_name(p) for p in points)
                raise JudgerRegistryError(
                    f"judger {name!r} is provided by several distributions: {owners}")
            if points:
                return self._load(points[0])
        raise JudgerRegistryError(f"unknown judger {name!r}; known judgers: {self.names()}")

    def create(self, name: str, /, **config: Any) -> Any:
        """Build the judger ``name`` with ``config`` as keyword arguments.

        Raises:
            JudgerRegistryError: unknown name, broken plugin, a config the factory does not
                accept (naming the parameters it does accept), or a result that is no judger.
        """
        factory = self.factory(name)
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):
            signature = None
        if signature is not None:
            try:
                signature.bind(**config)
            except TypeError as exc:
                params = [p for p in signature.parameters if p != "self"]
                raise JudgerRegistryError(
                    f"judger {name!r}: {exc} (it accepts: {params})") from None
        judger = factory(**config)
        try:
            plain_result(judger, f"judger {name!r}: its factory")
        except ContractError as exc:  # closed; a registry error, like any bad factory
            raise JudgerRegistryError(str(exc)) from None
        if not is_async_callable(getattr(judger, "judge", None)):
            raise JudgerRegistryError(
                f"judger {name!r}: {self._origins.get(name, _describe(factory))} built "
                f"{type(judger).__name__}, which has no 'async def judge(item)'")
        return judger

    def _entry_point_names(self) -> list[str]:
        if self.entry_point_group is None:
            return []
        return [p.name for p in metadata.entry_points(group=self.entry_point_group)]

    def _load(self, point: metadata.EntryPoint) -> JudgerFactory:
        where = (f"entry point {point.name!r} = {point.value!r} of distribution "
                 f"{_dist_name(point)!r}")
        try:
            obj: JudgerFactory = point.load()
        except Exception as exc:
            raise JudgerRegistryError(
                f"judger plugin failed to load: {where}: {type(exc).__name__}: {exc}") from exc
        if not callable(obj):
            raise JudgerRegistryError(f"judger plugin {where} is {obj!r}, not a class or factory")
        check_callable(obj, "factory", "sync", owner=f"judger plugin {where}",
                       shape="(**config) -> judger", error=JudgerRegistryError)
        # Importing the plugin may have registered it already (a decorator in its module).
        self.register(point.name, obj, replace=False)
        self._origins[point.name] = where
        return obj


def _dist_name(point: metadata.EntryPoint) -> str:
    dist = point.dist
    return dist.metadata["Name"] if dist is not None else "<unknown distribution>"


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


default_registry = JudgerRegistry()
"""The registry ``register_judger``/``get_judger`` use; holds the built-in judgers."""


@overload
def register_judger(name: str, factory: None = None, *, replace: bool = False
                    ) -> Callable[[F], F]: ...


@overload
def register_judger(name: str, factory: F, *, replace: bool = False) -> F: ...


def register_judger(name: str, factory: JudgerFactory | None = None, *,
                    replace: bool = False) -> Any:
    """Register a judger class (or factory) under ``name`` in the default registry.

    Use as a decorator, ``@register_judger("my_judge")``, or call it with the factory.

    Raises:
        JudgerRegistryError: the name is taken and ``replace`` is false, or is malformed.
    """
    return default_registry.register(name, factory, replace=replace)


def get_judger(name: str, /, **config: Any) -> Judger:
    """Build the judger registered as ``name`` (built-in, decorated, or a plugin's entry point).

    Args:
        name: the registered name.
        **config: keyword arguments for the judger's class or factory.

    Raises:
        JudgerRegistryError: unknown name (listing the known ones), a broken plugin, or a
            config the judger does not accept.
    """
    judger: Judger = default_registry.create(name, **config)
    return judger


def known_judgers() -> list[str]:
    """Names known to the default registry, plugins included, sorted."""
    return default_registry.names()
