"""`python -m infer.bench.quality`: how far a reduced-precision target is from the f32 one.

    python -m infer.bench.quality --weights int8,bf16,llama_cpp --prompts-per-category 12 \
        --max-new-tokens 64

On the benchmark prompts (`dloop_jax.data.bench_prompts`), for each computation
of the target against our f32 weights of the same file:

  - greedy: both decode the prompt (`ar`); the mean number of new tokens
    identical before the first difference, and the share of answers
    identical throughout;
  - next-token distributions: the f32 model's own greedy answer is fed to
    both (teacher forcing, one forward each); at every answer position the
    share of equal top-1 tokens and the mean KL(p_f32 || p_other) in nats.

The computations: our target with `int8` or `bf16` weights (`load_target(weights=)`,
this machine's profile), and `llama_cpp`, llama.cpp on the same GGUF file (its own
quantized blocks and dot products; the optional extra `pip install -e '.[llama-cpp]'`).
Prints one markdown table (docs/benchmarks.md keeps the figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Forwards are padded to a multiple of this many tokens: one program per bucket.
_BUCKET = 64
OURS = ("int8", "bf16")
LLAMA_CPP = "llama_cpp"


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.bench.quality", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct")
  p.add_argument("--weights", default="int8",
                 help="comma-separated computations compared with f32 weights: int8, bf16"
                      " (ours) and / or llama_cpp (llama.cpp on the same .gguf)")
  p.add_argument("--categories", default="math,code,chat")
  p.add_argument("--prompts-per-category", type=int, default=3)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                 help="llama.cpp's CPU threads")
  return p.parse_args(argv)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graph, state, tokens):
  """Logits [T, V] of one causal forward over tokens [1, T]."""
  model = nnx.merge(graph, state)
  t = tokens.shape[1]
  cache = model.init_cache(batch_size=1, capacity=t)
  return model(tokens, positions=jnp.arange(t)[None], cache=cache).logits[0]


@dataclasses.dataclass(frozen=True)
class Ours:
  """Our target (a `LoadedTarget`'s model): greedy `ar` and teacher-forced logits."""

  model: Any

  def greedy(self, ids: list[int], *, max_new_tokens: int) -> list[int]:
    from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
    return generate(self.model, [ids], max_new_tokens=max_new_tokens, mode="ar").tokens[0]

  def logits(self, ids: list[int]) -> np.ndarray:
    """[len(ids), V] f64: the next-token logits after every prefix of `ids`."""
    padded = -(-len(ids) // _BUCKET) * _BUCKET
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :len(ids)] = ids  # causal: the padding after them changes nothing before it
    graph, state = nnx.split(self.model)
    return np.asarray(_forward(graph, state, jnp.asarray(tokens)), np.float64)[:len(ids)]


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
  """llama.cpp on the GGUF file (a `llama_cpp.Llama` made with `logits_all=True`)."""

  model: Any

  def greedy(self, ids: list[int], *, max_new_tokens: int) -> list[int]:
    from infer.bench import llama_cpp_peer  # pylint: disable=g-import-not-at-top
    peer = llama_cpp_peer.LlamaCppPeer(model=self.model, max_new_tokens=max_new_tokens)
    return peer.run(ids).tokens

  def logits(self, ids: list[int]) -> np.ndarray:
    self.model.reset()
    self.model.eval(list(ids))
    return np.array(self.model.scores[:len(ids)], np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(reference, other, prompts: Sequence[list[int]], *, max_new_tokens: int) -> dict:
  """The figures of the module docstring for `other` against `reference`.

  Both are computations with `greedy(ids, max_new_tokens=)` and `logits(ids)`:
  `Ours` or `LlamaCpp`.
  """
  from dloop_jax.decoding.lossless import first_difference  # pylint: disable=g-import-not-at-top
  prefix, identical, agree, kl, positions = [], 0, 0, 0.0, 0
  for ids in prompts:
    ref = reference.greedy(ids, max_new_tokens=max_new_tokens)
    got = other.greedy(ids, max_new_tokens=max_new_tokens)
    first = first_difference(ref, got)
    identical += first is None
    prefix.append(min(len(ref), len(got)) if first is None else first)
    if not ref:
      continue
    context = ids + ref
    span = slice(len(ids) - 1, len(context) - 1)  # the positions that predict the answer
    p = _log_softmax(reference.logits(context)[span])
    q = _log_softmax(other.logits(context)[span])
    agree += int((p.argmax(-1) == q.argmax(-1)).sum())
    kl += float((np.exp(p) * (p - q)).sum())
    positions += len(ref)
  return dict(prompts=len(prompts), prefix=float(np.mean(prefix)),
              identical=identical / len(prompts), top1=agree / max(positions, 1),
              kl=kl / max(positions, 1), positions=positions)


def _llama_cpp(reference, *, threads: int, context: int) -> LlamaCpp:
  """llama.cpp on the reference's GGUF file, every position's logits kept."""
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from infer.bench import llama_cpp_peer  # pylint: disable=g-import-not-at-top
  why = llama_cpp_peer.missing(reference.source)
  if why is not None:
    raise ConfigError(why.replace("peer left out", "computation cannot run") +
                      " Leave llama_cpp out of --weights.")
  import llama_cpp  # pylint: disable=g-import-not-at-top
  return LlamaCpp(llama_cpp.Llama(model_path=os.fspath(reference.source), n_ctx=context,
                                  n_batch=context, n_threads=threads,
                                  n_threads_batch=threads, logits_all=True, verbose=False))


def main(argv=None) -> int:
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import load_target  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import bench_prompts as prompts_lib  # pylint: disable=g-import-not-at-top
  args = _parse(argv)
  try:
    names = [w for w in args.weights.split(",") if w]
    if not names or any(w not in OURS + (LLAMA_CPP,) for w in names):
      raise DLoopError(f"--weights takes int8, bf16 and / or {LLAMA_CPP}, got"
                       f" {args.weights!r}.")
    reference = load_target(args.target, weights="f32")
    tok = reference.tokenizer
    candidates = prompts_lib.load(args.categories.split(","),
                                  per_category=args.prompts_per_category)
    chosen = [p for c in args.categories.split(",")
              for p in [q for q in candidates if q.category == c][:args.prompts_per_category]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}]) for p in chosen]
    context = max(map(len, prompts)) + args.max_new_tokens + 1
    rows = {}
    for name in names:
      other = (_llama_cpp(reference, threads=args.threads, context=context)
               if name == LLAMA_CPP else Ours(load_target(args.target, weights=name).model))
      rows[name] = compare(Ours(reference.model), other, prompts,
                           max_new_tokens=args.max_new_tokens)
  except (DLoopError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"| computation vs our f32 weights ({args.target}, {len(prompts)} prompts x"
        f" {args.max_new_tokens} tokens) | greedy: identical tokens before the first difference"
        " (mean) | answers identical | top-1 agreement | mean KL(f32 ‖ it), nats |")
  print("|---|---|---|---|---|")
  for w, r in rows.items():
    print(f"| {w} | {r['prefix']:.1f} | {r['identical']:.0%} | {r['top1']:.2%} |"
          f" {r['kl']:.2e} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
