"""Drafter training: objectives, sharded train step, Orbax checkpointing (see docs/training.md).

Submodules are imported explicitly (`from dloop_jax.training import trainer`):
importing the package stays cheap.
"""
