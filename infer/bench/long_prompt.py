"""Long prompts: time and peak memory of greedy decoding, ours against transformers.

    python -m infer.bench.long_prompt                          # ~2k / 4k / 7k tokens, 16 new
    python -m infer.bench.long_prompt --tokens 7000 --weights f32 --weights default
    python -m infer.bench.long_prompt --tokens 7000 --profile gpu --no-hf  # an accelerator's defaults

Each (prompt length, method) runs in its own process, one after another and
interleaved per length, so that a method's peak resident memory (the child's
`ru_maxrss`) is its own: model loading, compilation and generation included.
The prompt is the benchmark prompts' text (`dloop_jax.data.bench_prompts`) joined and cut
to the requested number of tokens, the same ids for both methods. For ours
the table gives the generation time without compilation and the compilation
time; for transformers (`generate()`, f32, greedy, the same GGUF weights) the
`generate()` call. With f32 weights the greedy tokens of both are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def prompt_ids(tokenizer, num_tokens: int) -> list[int]:
  """The first `num_tokens` token ids of the benchmark prompts' text, repeated as needed."""
  from dloop_jax.data import bench_prompts  # pylint: disable=g-import-not-at-top
  texts = []
  for name in sorted(os.listdir(bench_prompts.DATA_DIR)):
    if name.endswith(".jsonl"):
      with open(os.path.join(bench_prompts.DATA_DIR, name), encoding="utf-8") as f:
        texts.extend(json.loads(line)["prompt"] for line in f if line.strip())
  ids = tokenizer.encode("\n\n".join(texts))
  while len(ids) < num_tokens:
    ids = ids + ids
  return ids[:num_tokens]


def _worker(args) -> dict:
  """Runs one method on one prompt in this process; returns its figures."""
  from dloop_jax.models.registry import load_target  # pylint: disable=g-import-not-at-top
  weights = None if args.weights == "default" else args.weights
  target = load_target(args.target, weights=weights, profile=args.profile)
  ids = prompt_ids(target.tokenizer, args.tokens)
  if args.worker == "hf":
    from infer.bench import methods  # pylint: disable=g-import-not-at-top
    import torch  # pylint: disable=g-import-not-at-top
    model = methods.load_hf_reference(target.source)
    x = torch.as_tensor([ids], dtype=torch.long)
    with torch.no_grad():
      t0 = time.perf_counter()
      out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new,
                           do_sample=False, temperature=None, top_p=None, top_k=None,
                           pad_token_id=0)
      seconds = time.perf_counter() - t0
    return dict(tokens=out[0, len(ids):].tolist(), seconds=seconds, compile_seconds=0.0)
  from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
  out = generate(target.model, [ids], max_new_tokens=args.new, mode="ar", profile=args.profile)
  return dict(tokens=list(out.tokens[0]), seconds=out.seconds,
              compile_seconds=out.compile_seconds,
              weights=str(target.model.weight_dtype))


def _spawn(argv: list[str]) -> dict:
  """Runs a worker; its JSON result plus its peak resident memory."""
  proc = subprocess.Popen([sys.executable, "-m", "infer.bench.long_prompt"] + argv,
                          stdout=subprocess.PIPE, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    raise RuntimeError(f"worker {argv} failed ({proc.returncode})")
  result = json.loads(out.strip().splitlines()[-1])
  result["peak_rss_gb"] = usage.ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux
  return result


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="smollm2-135m-instruct")
  p.add_argument("--tokens", type=int, action="append",
                 help="prompt lengths (repeatable; default 2000, 4000, 7000)")
  p.add_argument("--new", type=int, default=16, help="new tokens per prompt")
  p.add_argument("--weights", action="append", choices=("default", "f32", "bf16"),
                 help="our weight storage (repeatable; default: default and f32)")
  p.add_argument("--no-hf", action="store_true", help="leave transformers out")
  p.add_argument("--profile", choices=("cpu", "gpu", "tpu"), default=None,
                 help="load and decode ours with this backend profile (default: this backend's);"
                      " 'gpu' on a CPU runs an accelerator's bf16 compute, cache and forms")
  p.add_argument("--worker", choices=("jax", "hf"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    args.tokens = args.tokens[0]
    args.weights = args.weights[0]
    print(json.dumps(_worker(args)))
    return 0
  lengths = args.tokens or [2000, 4000, 7000]
  weights = list(dict.fromkeys(args.weights or ["default", "f32"]))
  print(f"{'tokens':>6}  {'method':<12} {'seconds':>8} {'compile':>8} {'peak GB':>8}"
        f"  {'vs hf':>6}  same tokens as hf")
  for n in lengths:
    common = ["--target", args.target, "--tokens", str(n), "--new", str(args.new)]
    if args.profile:
      common += ["--profile", args.profile]
    runs = {}
    if not args.no_hf:
      runs["hf"] = _spawn(common + ["--worker", "hf", "--weights", "f32"])
    for w in weights:
      runs[f"ours {w}"] = _spawn(common + ["--worker", "jax", "--weights", w])
    hf = runs.get("hf")
    for name, r in runs.items():
      ratio = f"{hf['seconds'] / r['seconds']:.2f}x" if hf and name != "hf" else ""
      same = "" if not hf or name == "hf" else str(r["tokens"] == hf["tokens"])
      print(f"{n:>6}  {name:<12} {r['seconds']:>8.2f} {r['compile_seconds']:>8.2f}"
            f" {r['peak_rss_gb']:>8.2f}  {ratio:>6}  {same}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
