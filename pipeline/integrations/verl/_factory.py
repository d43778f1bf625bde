"""The factory a verl agent-loop entry names: imported, called and checked, or a ConfigError.

verl's config is text, so an entry names its stage list's factory by dotted path (the one
place we accept one). Everything that can go wrong with it (module missing, its import
raising or calling ``sys.exit``, attribute missing, the factory raising or returning
something that is no stage list) becomes a :class:`~pipeline.ConfigError` naming the YAML
entry, raised when a worker first instantiates the entry.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline._exceptions import ConfigError
from pipeline._runner.pipeline import Pipeline


def resolve_factory(path: Any, where: str) -> Any:
    """The callable a dotted path (``pkg.module.make`` or ``pkg.module:make``) names.

    The module is imported here, so its own code runs: whatever it raises (a missing
    dependency, a ``RuntimeError``, ``sys.exit``) becomes the ``ConfigError``.

    Raises:
        ConfigError: naming ``where`` (the YAML entry) and the module missing, the exception
            its import raised, or the attribute missing.
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
    except (Exception, SystemExit) as exc:  # the module's own code runs here: anything
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and (
            module_name == exc.name or module_name.startswith(f"{exc.name}."))
        cause = f"{type(exc).__name__}: {exc}"
        what = (f"cannot import module {module_name!r} ({cause})" if missing
                else f"importing {module_name!r} raised {cause}")
        raise ConfigError(f"{where}: factory {path!r}: {what}", field="factory") from exc
    for part in attr.split("."):
        owner = getattr(target, "__name__", type(target).__name__)
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{where}: factory {path!r}: {owner!r} has no attribute "
                              f"{part!r}", field="factory") from None
        except Exception as exc:
            raise ConfigError(f"{where}: factory {path!r}: reading {part!r} of {owner!r} "
                              f"raised {type(exc).__name__}: {exc}", field="factory") from exc
    if not callable(target):
        raise ConfigError(f"{where}: factory {path!r} is a {type(target).__name__}, not "
                          "callable", field="factory")
    return target


def make_stages(path: Any, kwargs: Any, where: str) -> Any:
    """Call the factory ``path`` names with ``kwargs``; its stage list or ``Pipeline``.

    Raises:
        ConfigError: naming ``where``: the factory cannot be resolved (see
            :func:`resolve_factory`), ``kwargs`` is not a mapping, the factory raised, or it
            returned something else than a stage list (an iterable of stages; not a string or
            a mapping) or a ``Pipeline``.
    """
    factory = resolve_factory(path, where)
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{where}: option 'factory_kwargs' must be a mapping, got "
                          f"{kwargs!r:.80}", field="factory_kwargs")
    try:
        made = factory(**kwargs)
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"{where}: factory {path!r} raised {type(exc).__name__}: {exc}",
                          field="factory") from exc
    _check_made(made, f"{where}: factory {path!r}")
    return made


def _check_made(made: Any, where: str) -> None:
    """Refuse what a factory returned when it is no stage list or ``Pipeline``, saying what.

    Raises:
        ConfigError: naming ``where`` and the type returned.
    """
    if isinstance(made, Pipeline) or (isinstance(made, Iterable) and not isinstance(
            made, str | bytes | Mapping)):
        return  # Pipeline() checks each stage
    if inspect.isawaitable(made):
        close = getattr(made, "close", None)
        if callable(close):
            close()  # no "never awaited" warning for a coroutine we will not run
        raise ConfigError(f"{where} returned a {type(made).__name__}: the factory must be a "
                          "plain function (not async) returning the stage list or a Pipeline",
                          field="factory")
    if hasattr(made, "run") and hasattr(made, "name"):
        raise ConfigError(f"{where} returned one stage, {type(made).__name__} "
                          f"{getattr(made, 'name', None)!r:.60}, not a stage list: "
                          "wrap it in a list", field="factory")
    raise ConfigError(f"{where} returned {made!r:.80}, not a stage list or a Pipeline "
                      f"(a {type(made).__name__})", field="factory")
