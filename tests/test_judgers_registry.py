"""The judger registry: decorator registration, names, config errors, real entry points."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import AgentMessage, AgentRolloutItem, ConfigError, artifacts, parse_row
from pipeline.judgers import (
    ENTRY_POINT_GROUP,
    JudgeResult,
    JudgerRegistry,
    JudgerRegistryError,
    MathJudger,
    get_judger,
    known_judgers,
    register_judger,
)
from pipeline.judgers._registry import default_registry

PLUGIN_SRC = Path(__file__).parent / "judger_plugin"
BUILTINS = {"code", "exact_match", "function", "http", "llm", "math", "regex"}


def item_for(answer: str) -> AgentRolloutItem:
    return AgentRolloutItem(uid="u-0", group_id="u", data=parse_row({"prompt": "q"}),
                            artifacts={artifacts.MESSAGES: [
                                AgentMessage(role="assistant", content=answer)]})


class Shouty:
    """A custom judger: 1.0 for answers in capitals."""

    def __init__(self, bonus: float = 0.0) -> None:
        self.bonus = bonus

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        text = item.artifacts[artifacts.MESSAGES][-1].content
        return JudgeResult(score=float(text.isupper()) + self.bonus)


async def test_register_by_decorator_and_build_by_name() -> None:
    registry = JudgerRegistry(entry_point_group=None)

    @registry.register("shouty")
    class Local(Shouty):
        pass

    judge = registry.create("shouty", bonus=0.5)
    assert isinstance(judge, Local)
    assert (await judge.judge(item_for("YES"))).score == 1.5
    assert registry.names() == ["shouty"] and "shouty" in registry


def test_default_registry_decorator_and_get_judger() -> None:
    @register_judger("test_registry_shouty")
    class Decorated(Shouty):
        pass

    try:
        assert isinstance(get_judger("test_registry_shouty"), Decorated)
        assert "test_registry_shouty" in known_judgers()
        assert BUILTINS <= set(known_judgers())
        assert isinstance(get_judger("math", rel_tol=0.0), MathJudger)
    finally:
        default_registry.unregister("test_registry_shouty")


def test_registering_a_name_twice_needs_replace() -> None:
    registry = JudgerRegistry(entry_point_group=None)
    registry.register("j", Shouty)
    registry.register("j", Shouty)  # the very same class again: fine

    class Other(Shouty):
        pass

    with pytest.raises(JudgerRegistryError, match=r"'j' is already registered .*replace=True"):
        registry.register("j", Other)
    registry.register("j", Other, replace=True)
    assert isinstance(registry.create("j"), Other)
    with pytest.raises(JudgerRegistryError, match="is invalid"):
        registry.register("has space", Shouty)


def test_unknown_names_list_the_known_ones() -> None:
    registry = JudgerRegistry(entry_point_group=None)
    registry.register("alpha", Shouty)
    registry.register("beta", Shouty)
    with pytest.raises(JudgerRegistryError,
                       match=r"unknown judger 'gamma'; known judgers: \['alpha', 'beta'\]"):
        registry.create("gamma")
    with pytest.raises(ConfigError):  # a registry error is a config error
        get_judger("no_such_judger_anywhere")


def test_config_the_judger_does_not_accept_is_named() -> None:
    registry = JudgerRegistry(entry_point_group=None)
    registry.register("shouty", Shouty)
    with pytest.raises(JudgerRegistryError,
                       match=r"judger 'shouty': .*'volume'.*it accepts: \['bonus'\]"):
        registry.create("shouty", volume=11)


def test_a_factory_that_builds_no_judger_is_rejected() -> None:
    registry = JudgerRegistry(entry_point_group=None)
    registry.register("sync_only", lambda: object())
    with pytest.raises(JudgerRegistryError, match="has no 'async def judge"):
        registry.create("sync_only")


# ---- a real entry point of an installed distribution --------------------------------------

@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pip-install the test plugin (a copy: in-tree builds write into the source) into a
    temporary target and put it on sys.path, as an installed distribution."""
    work = tmp_path_factory.mktemp("plugin")
    src = work / "src"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                     "*.egg-info"))
    target = work / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--target", str(target),
         str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.startswith("judger_plugin_demo")]:
        del sys.modules[name]
    importlib.invalidate_caches()


async def test_entry_point_judger_is_found_and_loaded_lazily(installed_plugin: Path) -> None:
    registry = JudgerRegistry()
    assert {"demo_length", "demo_broken", "demo_missing"} <= set(registry.names())
    assert "judger_plugin_demo.judgers" not in sys.modules  # listing loads nothing
    judge = registry.create("demo_length", max_chars=3)
    assert type(judge).__module__ == "judger_plugin_demo.judgers"
    result = JudgeResult.coerce(await judge.judge(item_for("abcd")))
    assert result.score == 0.0 and result.payload == {"length": 4}
    assert registry.factory("demo_length") is type(judge)  # loaded once, then registered


def test_entry_point_through_the_default_registry(installed_plugin: Path) -> None:
    try:
        assert "demo_length" in known_judgers()
        assert type(get_judger("demo_length")).__name__ == "LengthJudger"
    finally:
        default_registry.unregister("demo_length")


def test_broken_plugins_are_reported_clearly(installed_plugin: Path) -> None:
    registry = JudgerRegistry()
    with pytest.raises(JudgerRegistryError) as info:
        registry.create("demo_broken")
    message = str(info.value)
    assert "judger plugin failed to load" in message
    assert "'demo_broken'" in message and "judger_plugin_demo.broken:BrokenJudger" in message
    assert "'pipeline-judger-plugin-demo'" in message
    assert "ModuleNotFoundError" in message and "missing_dependency" in message
    with pytest.raises(JudgerRegistryError, match=r"demo_missing.*AttributeError"):
        registry.create("demo_missing")
    # One broken plugin does not break the others.
    assert registry.create("demo_length") is not None


def test_entry_points_can_be_turned_off(installed_plugin: Path) -> None:
    registry = JudgerRegistry(entry_point_group=None)
    assert registry.names() == []
    with pytest.raises(JudgerRegistryError, match="unknown judger 'demo_length'"):
        registry.create("demo_length")
    assert ENTRY_POINT_GROUP == "pipeline.judgers"


def test_registered_names_win_over_entry_points(installed_plugin: Path) -> None:
    registry = JudgerRegistry()
    registry.register("demo_length", Shouty)
    judge: Any = registry.create("demo_length")
    assert isinstance(judge, Shouty)
