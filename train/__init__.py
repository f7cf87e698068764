"""`python -m train`: the command line over `dloop_jax.training` (see docs/training.md)."""
