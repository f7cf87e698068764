"""Drafters: the interface the engine drives, and the drafters DLoop applies to."""

from dloop_jax.drafters.base import Drafter, DraftStage

__all__ = ["Drafter", "DraftStage"]
