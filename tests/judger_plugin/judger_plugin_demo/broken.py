"""A plugin module that cannot be imported (its dependency is missing)."""

import judger_plugin_demo_missing_dependency  # noqa: F401


class BrokenJudger:
    async def judge(self, item: object) -> float:
        return 1.0
