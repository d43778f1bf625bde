"""Test plugin for pipeline's judger registry (see pyproject.toml)."""
