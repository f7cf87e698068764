"""Training configs: one file per (target, drafter, recipe); `tiny_*` for tests."""
