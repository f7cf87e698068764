"""Command-line generation: `python -m infer`."""
