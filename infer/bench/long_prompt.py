"""Long prompts: time and peak memory of greedy decoding, ours against transformers.

    python -m infer.bench.long_prompt                          # ~2k / 4k / 7k tokens, 16 new
    python -m infer.bench.long_prompt --tokens 7000 --weights f32 --weights default
    python -m infer.bench.long_prompt --tokens 7000 --profile gpu --no-hf  # an accelerator's defaults

Each (prompt length, method) runs in its own process, one after another and
interleaved per length, so that neither method shares a process (threads,
allocator, memory) with the other, and a method's peak resident memory (the
child's `ru_maxrss`) is its own: model loading, compilation and generation
included. The transformers process imports neither JAX nor our model. The
prompt is the benchmark prompts' text (`dloop_jax.data.bench_prompts`) joined
and cut to the requested number of tokens, the same ids for both methods
(tokenized once by the parent).

Each process decodes the prompt twice: one new token (the prefill and the
first token: "first token s") and `--new` new tokens ("total s"); our
compilation is timed apart ("compile s", both programs). transformers runs `generate()` in f32 on the same GGUF weights with
torch's threads set to the CPU's cores. With f32 weights the greedy tokens of
both are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def _hf_worker(args, ids: list[int]) -> dict:
  """transformers `generate()` (f32, greedy) of the same GGUF file; no JAX in this process."""
  from infer.bench import methods  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  model = methods.load_hf_reference(args.source, threads=os.cpu_count())
  x = torch.as_tensor([ids], dtype=torch.long)
  # No stop token, as ours: both decode exactly `new` tokens.
  model.generation_config.eos_token_id = None

  def run(new):
    with torch.no_grad():
      t0 = time.perf_counter()
      out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                           do_sample=False, temperature=None, top_p=None,
                           top_k=None, pad_token_id=0)
      return out[0, len(ids):].tolist(), time.perf_counter() - t0

  _, first = run(1)
  tokens, seconds = run(args.new)
  return dict(tokens=tokens, first_seconds=first, seconds=seconds, compile_seconds=0.0,
              threads=torch.get_num_threads())


def _jax_worker(args, ids: list[int]) -> dict:
  """Our `ar` decoding (the prefill every mode shares) with the chosen weights and profile."""
  from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.registry import load_target  # pylint: disable=g-import-not-at-top
  weights = None if args.weights == "default" else args.weights
  target = load_target(args.source, weights=weights, profile=args.profile)

  def run(new):  # `seconds` leaves the compilation out (`compile_seconds`)
    return generate(target.model, [ids], max_new_tokens=new, mode="ar", profile=args.profile)

  first = run(1)
  out = run(args.new)
  return dict(tokens=list(out.tokens[0]), first_seconds=first.seconds, seconds=out.seconds,
              compile_seconds=first.compile_seconds + out.compile_seconds,
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
  p.add_argument("--source", help=argparse.SUPPRESS)
  p.add_argument("--ids", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    args.weights = args.weights[0]
    with open(args.ids, encoding="utf-8") as f:
      ids = json.load(f)
    worker = _hf_worker if args.worker == "hf" else _jax_worker
    print(json.dumps(worker(args, ids)))
    return 0
  from dloop_jax.models import registry  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  source = (registry.registry_path(args.target) if args.target in registry.REGISTRY
            else args.target)
  if not source.endswith(".gguf"):
    raise SystemExit("long_prompt compares GGUF targets (transformers loads the same file).")
  tokenizer = Tokenizer.from_gguf(source)
  lengths = args.tokens or [2000, 4000, 7000]
  weights = list(dict.fromkeys(args.weights or ["default", "f32"]))
  print(f"{'tokens':>6}  {'method':<16} {'first token s':>13} {'total s':>8} {'compile s':>9}"
        f" {'peak GB':>8}  {'hf / ours':>9}  same tokens as hf", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    for n in lengths:
      ids_file = os.path.join(tmp, f"ids_{n}.json")
      with open(ids_file, "w", encoding="utf-8") as f:
        json.dump(prompt_ids(tokenizer, n), f)
      common = ["--source", source, "--ids", ids_file, "--new", str(args.new)]
      if args.profile:
        common += ["--profile", args.profile]
      runs = {}
      if not args.no_hf:
        runs["transformers"] = _spawn(common + ["--worker", "hf", "--weights", "f32"])
      for w in weights:
        runs[f"ours {w}"] = _spawn(common + ["--worker", "jax", "--weights", w])
      hf = runs.get("transformers")
      for name, r in runs.items():
        ours = hf and name != "transformers"
        ratio = (f"{hf['first_seconds'] / r['first_seconds']:.2f}x/{hf['seconds'] / r['seconds']:.2f}x"
                 if ours else "")
        same = str(r["tokens"] == hf["tokens"]) if ours else ""
        label = name + (f" ({r['weights']})" if "weights" in r and "default" in name else "")
        print(f"{n:>6}  {label:<16} {r['first_seconds']:>13.2f} {r['seconds']:>8.2f}"
              f" {r['compile_seconds']:>9.2f} {r['peak_rss_gb']:>8.2f}  {ratio:>9}  {same}",
              flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
