"""A factory module whose import raises (issue 33 item 9). PYTEST_DONT_REWRITE"""

raise RuntimeError("CUDA_VISIBLE_DEVICES is empty")


def make() -> list[object]:  # pragma: no cover - never reached
    return []
