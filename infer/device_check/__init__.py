"""`python -m infer.device_check`: correctness and speed of the engine on a new accelerator.

  checks    greedy ar = sd = dloop comparisons and the sampling smoke test
  speed     in-loop ms per step / round against isolated forwards; prefill tokens/s
  kernels   prefill attention implementations, decode after a long prompt, peak memory,
            cache copies in the optimized loops
  quantized int8 weights' weight-only products: read inside the product (HLO), ms against bf16
  report    results.json, summary.md and the one-line verdict
"""
