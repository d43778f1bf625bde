"""Runnable end-to-end examples: each module is a stage list plus a small dataset.

A scenario module provides ``rows(count, seed)``, ``stages()``, optionally ``tools()``, and
``responder(tokenizer)`` for the simulated engine. ``rollout run NAME`` runs one.
"""
