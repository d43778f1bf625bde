"""Inference engines: the protocol and its implementations."""

from pipeline.engines.base import Engine, Generation
from pipeline.engines.simulated import SimulatedEngine

__all__ = ["Engine", "Generation", "SimulatedEngine"]
