"""A factory module that imports a package that is not installed (issue 33 item 9).

PYTEST_DONT_REWRITE
"""

import pipeline_no_such_dependency  # type: ignore[import-not-found]  # noqa: F401


def make() -> list[object]:  # pragma: no cover - never reached
    return []
