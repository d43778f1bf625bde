"""``add_dump_section``: state from elsewhere (a Ray driver's workers) in every dump."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.diagnostics import TaskDumper, add_dump_section


def test_a_section_is_in_the_text_and_json_dump_until_removed(tmp_path: Path) -> None:
    calls: list[int] = []

    def workers() -> tuple[str, object]:
        calls.append(1)
        return "worker-0: 3 samples in flight", {"worker-0": {"samples": 3}}

    def broken() -> tuple[str, object]:
        raise RuntimeError("worker unreachable")

    remove = add_dump_section("fleet", workers)
    remove_broken = add_dump_section("broken", broken)
    dumper = TaskDumper(tmp_path, signum=None, trigger_socket=False)
    try:
        path = dumper.dump("test")
        text = path.read_text()
        assert "== fleet ==\nworker-0: 3 samples in flight" in text
        assert "== broken ==\n(section failed: RuntimeError: worker unreachable)" in text
        data = json.loads(path.with_suffix(".json").read_text())
        assert data["sections"]["fleet"] == {"worker-0": {"samples": 3}}
        assert "pid" in data  # the snapshot itself is still there
        remove()
        remove_broken()
        second = dumper.dump("test").read_text()
        assert "== fleet ==" not in second and len(calls) == 1
    finally:
        remove()
        remove_broken()
        dumper.close()
