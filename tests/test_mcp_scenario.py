"""scenarios/order_desk.py end to end: an MCP tool (a real stdio server subprocess), a
per-trajectory notepad from a warm pool and a simulated customer, in one trajectory each."""

from __future__ import annotations

import pytest

from pipeline import artifacts
from pipeline.stages import USER_TURNS

pytest.importorskip("mcp")
pytest.importorskip("transformers")


async def test_order_desk_runs_every_part_in_one_trajectory():
    from scenarios import order_desk

    out = await order_desk.run(count=2, n=2, pool_size=4)
    result = out["result"]
    assert [s.status for s in result.samples] == ["completed"] * 4
    assert [s.reward for s in result.samples] == [1.0] * 4
    for sample, item in zip(result.samples, result.items, strict=True):
        roles = [m.role for m in item.artifacts[artifacts.MESSAGES]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user",
                         "assistant", "tool", "assistant"]
        assert [t["stopped"] for t in item.artifacts[USER_TURNS]] == [False, True]
        extra = item.artifacts[artifacts.EXTRA_FIELDS]
        assert extra["tool_resources_warm"] == 1 and extra["tool_rewards"] == [0.1]
        assert 0 in sample.response_mask and 1 in sample.response_mask
    assert out["pool"]["hits"] == 4 and out["pool"]["misses"] == 0
    assert out["restarts"] == 0
