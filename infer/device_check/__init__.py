"""`python -m infer.device_check`: correctness and speed of the engine on a new accelerator.

  checks    greedy ar = sd = dloop comparisons and the sampling smoke test
  speed     in-loop ms per step / round against isolated forwards; prefill tokens/s
  report    results.json, summary.md and the one-line verdict
"""
