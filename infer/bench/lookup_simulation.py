"""`python -m infer.bench.lookup_simulation`: draft sources that need no training, simulated.

    python -m infer.bench.lookup_simulation                      # 16 prompts per category
    python -m infer.bench.lookup_simulation --prompts-per-category 4 --max-new-tokens 64

Would prompt lookup, or an n-gram table of the training answers, supply an
accepted continuation where the neural drafter's first stage fails? Greedy
answers are deterministic, so a round of greedy verification anchored at answer
token i (the last committed token) accepts exactly the prefix of its draft that
matches answer tokens i+1, i+2, ...; the whole question is then simulated
offline on the target's answers:

  1. The target answers the benchmark prompts of each category (`ar`, greedy,
     f32, the tapped hidden states captured).
  2. At every answer position i, the drafts of one round at gamma:
     N  the block drafter's, teacher-forced exactly as the engine feeds it after
        committing up to i (target context of positions < i, anchor token i:
        `BlockDrafter.train_stages`, one stage);
     P  prompt lookup (`prompt_lookup`): the latest earlier occurrence of the
        longest suffix (n = 3..1) of prompt + answer so far, and the gamma
        tokens that followed it;
     G  an n-gram table of the training answers (`NgramTable`): the suffix
        (n = 3..1, longest known) -> its most frequent next gamma tokens.
  3. Rounds in sequence from the answer's first token: a round at i accepts a
     drafts and commits a + 1 tokens, the next starts at i + a + 1 (`tau`).

Combined sources (X = P or G) in the table:
  N|X oracle  the better of both where N's first draft is rejected: an upper
              bound (it needs the answer to choose).
  N|X rule    X's draft where X matched a suffix of n >= 2 tokens and the
              drafter's first draft has probability < 0.5, else N's: a rule
              the engine could run (fixed before measuring).

With --engine-check, the engine's own `sd` (every draft verified) runs on the
same prompts, and its τ is printed beside N's simulated τ.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

GAMMA = 4
MAX_NGRAM = 3
# The realistic rule (module docstring): lookup drafts when their match is at
# least this long and the drafter's first draft is less likely than this.
RULE_MIN_NGRAM = 2
RULE_MAX_P1 = 0.5
_NONE = -1  # padding of table drafts past an answer's end (never a token)
_KEY_BITS = 16  # token ids per n-gram key slot


def accepted_length(draft: Sequence[int], truth: Sequence[int]) -> int:
  """How many leading tokens of `draft` equal `truth`'s (what greedy verification accepts)."""
  n = 0
  for d, t in zip(draft, truth):
    if d != t:
      break
    n += 1
  return n


def prompt_lookup(tokens: np.ndarray, anchor: int, *, gamma: int = GAMMA,
                  max_ngram: int = MAX_NGRAM) -> tuple[np.ndarray, int]:
  """Prompt lookup's draft after `tokens[:anchor + 1]` (the anchor is the last committed token).

  The longest suffix of the context (n = max_ngram .. 1 tokens) that also
  occurs earlier in it, at its latest occurrence; the draft is the (up to)
  gamma tokens that followed that occurrence.

  Returns:
    (draft [<= gamma] int, n): n = 0 and an empty draft without a match.
  """
  ctx = np.asarray(tokens[:anchor + 1])
  for n in range(min(max_ngram, anchor), 0, -1):
    # windows[j] = ctx[j:j + n], ending before the anchor.
    windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
    hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
    if hits.size:
      after = hits[-1] + n
      return ctx[after:after + gamma], n
  return ctx[:0], 0


def _keys(windows: np.ndarray) -> np.ndarray:
  """n-grams [..., n] -> int64 keys (ids below 2**16)."""
  key = np.zeros(windows.shape[:-1], np.int64)
  for i in range(windows.shape[-1]):
    key = (key << _KEY_BITS) | windows[..., i].astype(np.int64)
  return key


@dataclasses.dataclass(frozen=True)
class NgramTable:
  """For n = 1..max_ngram: every n-gram seen before an answer token -> its most frequent
  next gamma tokens (ties: the smallest ids).

  Attributes:
    keys: per n, [K_n] sorted int64 keys of the n-grams.
    drafts: per n, [K_n, gamma] int32 continuations (-1 past an answer's end).
  """

  keys: tuple[np.ndarray, ...]
  drafts: tuple[np.ndarray, ...]

  @classmethod
  def build(cls, sequences: Sequence[np.ndarray], answer_starts: Sequence[int], *,
            gamma: int = GAMMA, max_ngram: int = MAX_NGRAM) -> "NgramTable":
    """The table of `sequences` (prompt + answer each; the answer starts at `answer_starts`).

    Only n-grams followed by an answer token count: the continuation starts in
    the answer, the n-gram may reach into the prompt's end (its chat template).
    """
    if any(int(np.max(s, initial=0)) >= 1 << _KEY_BITS for s in sequences):
      raise ValueError(f"Token ids must be below {1 << _KEY_BITS} for the n-gram keys.")
    keys, drafts = [], []
    for n in range(1, max_ngram + 1):
      ks, cs = [], []
      for seq, start in zip(sequences, answer_starts):
        seq = np.asarray(seq, np.int64)
        ends = np.arange(max(start - 1, n - 1), len(seq) - 1)  # last token of the n-gram
        if ends.size == 0:
          continue
        padded = np.concatenate([seq, np.full(gamma, _NONE, np.int64)])
        ks.append(_keys(padded[ends[:, None] + np.arange(1 - n, 1)]))
        cs.append(padded[ends[:, None] + np.arange(1, gamma + 1)])
      k = np.concatenate(ks) if ks else np.zeros((0,), np.int64)
      c = np.concatenate(cs) if cs else np.zeros((0, gamma), np.int64)
      order = np.lexsort(tuple(c[:, i] for i in reversed(range(gamma))) + (k,))
      k, c = k[order], c[order]
      new = np.ones(k.size, bool)
      new[1:] = (k[1:] != k[:-1]) | (c[1:] != c[:-1]).any(axis=1)
      first = np.flatnonzero(new)
      counts = np.diff(np.append(first, k.size))
      k, c = k[first], c[first]
      best = np.lexsort((-counts, k))  # stable: among equal counts the smallest continuation
      k, c = k[best], c[best]
      head = np.ones(k.size, bool)
      head[1:] = k[1:] != k[:-1]
      keys.append(k[head])
      drafts.append(c[head].astype(np.int32))
    return cls(keys=tuple(keys), drafts=tuple(drafts))

  def propose(self, context: np.ndarray) -> tuple[np.ndarray, int]:
    """The draft after `context` (its last token is the anchor): (draft, n); n = 0: none."""
    for n in range(min(len(self.keys), len(context)), 0, -1):
      key = _keys(np.asarray(context[-n:])[None])[0]
      i = np.searchsorted(self.keys[n - 1], key)
      if i < self.keys[n - 1].size and self.keys[n - 1][i] == key:
        draft = self.drafts[n - 1][i]
        return draft[draft != _NONE], n
    return np.zeros((0,), np.int32), 0


def tau(accepted: Sequence[int], *, length: int) -> tuple[int, int]:
  """Greedy rounds in sequence over an answer of `length` tokens.

  Args:
    accepted: [>= length - 1] drafts a round anchored at answer token i would
      accept (the first answer token comes from prefill, so rounds anchor at
      0 .. length - 2).
    length: answer tokens.

  Returns:
    (committed, rounds): tokens committed by the rounds (length - 1) and the
    rounds (target verifications); τ = committed / rounds.
  """
  i = rounds = 0
  while i < length - 1:
    i += min(int(accepted[i]) + 1, length - 1 - i)
    rounds += 1
  return max(length - 1, 0), rounds


# ---------------------------------------------------------------------- neural


def neural_drafts(drafter, *, tokens: np.ndarray, features: np.ndarray, answer_start: int,
                  width: int, num_anchors: int, head_rows) -> tuple[np.ndarray, np.ndarray]:
  """The block drafter's teacher-forced draft at every answer position.

  Args:
    drafter: a `BlockDrafter`.
    tokens: [T] prompt + answer.
    features: [T - 1, n_taps, D] the target's taps at the positions it read.
    answer_start: the prompt's length (index of the first answer token).
    width: T is padded to this, the anchors to `num_anchors` (one compiled program).
    num_anchors: at least the answer's length - 1.
    head_rows: the LM-head rows drafting reads (`BlockState.head_rows`).

  Returns:
    (drafts [A, gamma] target ids, p1 [A] the first draft's probability), A =
    T - 1 - answer_start anchors (answer tokens 0 .. length - 2).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  t = len(tokens)
  num = t - 1 - answer_start
  if t > width or num > num_anchors:
    raise ValueError(f"prompt + answer of {t} tokens ({num} anchors) exceed width {width}"
                     f" ({num_anchors} anchors).")
  tok = np.zeros((1, width), np.int32)
  tok[0, :t] = tokens
  feats = np.zeros((1, width) + features.shape[1:], np.float32)
  feats[0, :features.shape[0]] = features
  anchors = np.minimum(answer_start + np.arange(num_anchors), t - 1)[None].astype(np.int32)
  drafts, p1 = _draft_fn()(drafter, jnp.asarray(tok), jnp.asarray(feats), jnp.asarray(anchors),
                           head_rows)
  return np.asarray(drafts)[0, :num], np.asarray(p1)[0, :num]


_DRAFT_FN = []


def _draft_fn():
  if not _DRAFT_FN:
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top

    @nnx.jit
    def fn(drafter, tokens, features, anchors, head_rows):
      width = tokens.shape[1]
      (h,) = drafter.train_stages(
          tokens=tokens, features=features, positions=jnp.arange(width)[None],
          segment_ids=jnp.ones_like(tokens), anchors=anchors,
          block_size=drafter.block_size, num_stages=1)
      logits = drafter.draft_logits(h, head_rows=head_rows)  # [1, A, gamma, Vd]
      ids = drafter.to_target_ids(jnp.argmax(logits, axis=-1))
      p1 = jnp.max(jax.nn.softmax(logits[:, :, 0].astype(jnp.float32), axis=-1), axis=-1)
      return ids, p1

    _DRAFT_FN.append(fn)
  return _DRAFT_FN[0]


# ------------------------------------------------------------------ per answer


POLICIES = ("N", "P", "G", "N|P oracle", "N|P rule", "N|G oracle", "N|G rule")


def answer_rounds(*, tokens: np.ndarray, answer_start: int, neural: np.ndarray, p1: np.ndarray,
                  table: NgramTable, gamma: int = GAMMA) -> dict[str, object]:
  """Every policy's (committed, rounds) on one answer, and how N's failed rounds fare.

  Args:
    tokens: [T] prompt + answer.
    answer_start: index of the first answer token.
    neural: [T - 1 - answer_start, gamma] N's drafts per anchor; p1 their first's probability.
    table: the training answers' `NgramTable`.

  Returns:
    {policy: (committed, rounds)} plus "fails" (N's rounds, in N's own sequence,
    whose first draft is rejected) and "rescued_P" / "rescued_G" (of those, the
    rounds where P / G would have had a draft accepted).
  """
  length = len(tokens) - answer_start
  acc = {k: np.zeros(max(length - 1, 0), np.int64) for k in ("N", "P", "G")}
  ngram = {k: np.zeros(max(length - 1, 0), np.int64) for k in ("P", "G")}
  for i in range(length - 1):
    a = answer_start + i
    truth = tokens[a + 1:a + 1 + gamma]
    acc["N"][i] = accepted_length(neural[i], truth)
    draft, ngram["P"][i] = prompt_lookup(tokens, a, gamma=gamma)
    acc["P"][i] = accepted_length(draft, truth)
    draft, ngram["G"][i] = table.propose(tokens[:a + 1])
    acc["G"][i] = accepted_length(draft, truth)
  out = {k: tau(acc[k], length=length) for k in ("N", "P", "G")}
  low = p1[:length - 1] < RULE_MAX_P1
  for x in ("P", "G"):
    out[f"N|{x} oracle"] = tau(np.where(acc["N"] == 0, acc[x], acc["N"]), length=length)
    use = (ngram[x] >= RULE_MIN_NGRAM) & low
    out[f"N|{x} rule"] = tau(np.where(use, acc[x], acc["N"]), length=length)
  starts, i = [], 0
  while i < length - 1:
    starts.append(i)
    i += int(acc["N"][i]) + 1
  fails = [s for s in starts if acc["N"][s] == 0]
  out["fails"] = len(fails)
  for x in ("P", "G"):
    out[f"rescued_{x}"] = sum(int(acc[x][s] > 0) for s in fails)
  return out


def bootstrap(rows: Sequence[dict], policy: str, *, base: str | None = None,
              samples: int = 2000, seed: int = 0) -> tuple[float, float]:
  """τ of `policy` over `rows` (summed committed / summed rounds) and its bootstrap standard
  error over prompts; with `base`, the same for τ(policy) - τ(base) (paired)."""
  c = np.array([r[policy][0] for r in rows], float)
  n = np.array([r[policy][1] for r in rows], float)
  cb = np.array([r[base][0] for r in rows], float) if base else None
  nb = np.array([r[base][1] for r in rows], float) if base else None

  def stat(idx):
    v = c[idx].sum() / max(n[idx].sum(), 1)
    return v - cb[idx].sum() / max(nb[idx].sum(), 1) if base else v

  rng = np.random.default_rng(seed)
  draws = [stat(rng.integers(0, len(rows), len(rows))) for _ in range(samples)]
  return float(stat(np.arange(len(rows)))), float(np.std(draws))


# ----------------------------------------------------------------------- main


def read_store(directory: str) -> tuple[list[np.ndarray], list[int]]:
  """Prompt + answer token ids of every chunk of a response store, and each answer's start."""
  paths = sorted(glob.glob(os.path.join(directory, "chunk_*.npz")))
  if not paths:
    raise FileNotFoundError(f"No chunk_*.npz in {directory}: point --store at a response store"
                            " (data/responses/<store name>).")
  sequences, starts = [], []
  for path in paths:
    with np.load(path) as z:
      ends = np.cumsum(z["lengths"])
      for seq, p in zip(np.split(z["tokens"], ends[:-1]), z["prompt_lens"]):
        sequences.append(seq)
        starts.append(int(p))
  return sequences, starts


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.bench.lookup_simulation", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct")
  p.add_argument("--drafter", default="",
                 help="a block drafter (name or export dir); default: the target's first"
                      " shipped drafter")
  p.add_argument("--store", default=os.path.join(
      "data", "responses", "smollm2_135m_instruct_answers_29199fc8ea"),
                 help="response store of the drafter's training answers (the n-gram table)")
  p.add_argument("--categories", default="math,code,chat")
  p.add_argument("--prompts-per-category", type=int, default=16)
  p.add_argument("--max-new-tokens", type=int, default=256)
  p.add_argument("--max-prompt-tokens", type=int, default=512)
  p.add_argument("--engine-check", action="store_true",
                 help="also run the engine's sd (every draft verified) and print its τ")
  p.add_argument("--data-dir", default=None, help="where the ShareGPT dataset is")
  return p.parse_args(argv)


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
  args = _parse(argv)
  from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import BlockDrafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import registry  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import bench_prompts as prompts_lib  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  sequences, starts = read_store(args.store)
  table = NgramTable.build(sequences, starts)
  _log(f"[lookup] n-gram table of {len(sequences)} training answers"
       f" ({sum(len(s) - p for s, p in zip(sequences, starts))} answer tokens;"
       f" {', '.join(str(k.size) for k in table.keys)} 1/2/3-grams)"
       f" in {time.perf_counter() - t0:.0f}s")

  target = registry.load_target(args.target, weights="f32")
  tok = target.tokenizer
  name = args.drafter or drafter_io.shipped_drafters_for(target.model.config)[0]
  drafter = drafter_io.load_drafter(name, target=target.model)
  if type(drafter) is not BlockDrafter:  # pylint: disable=unidiomatic-typecheck
    raise SystemExit(f"{name} is a {drafter.name} drafter; the simulation teacher-forces a plain"
                     " block drafter (--drafter smollm2-135m-instruct-block).")
  if drafter.block_size != GAMMA:
    raise SystemExit(f"{name} drafts {drafter.block_size} tokens a stage; the simulation is at"
                     f" gamma {GAMMA}.")
  head_rows = drafter.init_state(batch_size=1, capacity=1).head_rows
  stops = list(tok.stop_token_ids)
  width = args.max_prompt_tokens + args.max_new_tokens

  categories = [c.strip() for c in args.categories.split(",") if c.strip()]
  per = args.prompts_per_category
  chosen: dict[str, list[list[int]]] = {c: [] for c in categories}
  for p in prompts_lib.load(categories, per_category=per, data_dir=args.data_dir):
    ids = tok.apply_chat_template([{"role": "user", "content": p.text}],
                                  add_generation_prompt=True)
    if len(chosen[p.category]) < per and len(ids) <= args.max_prompt_tokens:
      chosen[p.category].append(list(ids))

  # All categories in one batch: one compiled program per mode.
  labels = [c for c in categories for _ in chosen[c]]
  prompts = [ids for c in categories for ids in chosen[c]]
  t0 = time.perf_counter()
  out = generate(target.model, prompts, max_new_tokens=args.max_new_tokens, mode="ar",
                 stop_tokens=stops, capture_taps=drafter.taps)
  _log(f"[lookup] {len(prompts)} answers in {time.perf_counter() - t0:.0f}s")
  results: dict[str, list[dict]] = {c: [] for c in categories}
  for category, prompt, answer, feats in zip(labels, prompts, out.tokens, out.features):
    tokens = np.asarray(prompt + answer, np.int32)
    neural, p1 = neural_drafts(drafter, tokens=tokens, features=feats,
                               answer_start=len(prompt), width=width,
                               num_anchors=args.max_new_tokens, head_rows=head_rows)
    row = answer_rounds(tokens=tokens, answer_start=len(prompt), neural=neural, p1=p1,
                        table=table)
    row["tokens"] = len(answer)
    results[category].append(row)
  _log(f"[lookup] simulated in {time.perf_counter() - t0:.0f}s")
  engine_tau = {}
  if args.engine_check:
    sd = generate(target.model, prompts, max_new_tokens=args.max_new_tokens, mode="sd",
                  drafter=drafter, schedule="off", draft_backoff=0, stop_tokens=stops)
    differ = sum(a != b for a, b in zip(sd.tokens, out.tokens))
    if differ:
      _log(f"[lookup] sd's tokens differ from ar's on {differ} prompts")
    for category in categories:
      rows = [r for c, r in zip(labels, sd.rows) if c == category]
      engine_tau[category] = (sum(r.committed_in_rounds for r in rows)
                              / max(sum(r.rounds for r in rows), 1))
    _log(f"[lookup] engine check in {time.perf_counter() - t0:.0f}s")

  print(f"\nτ at γ = {GAMMA} (± bootstrap standard error over prompts); drafter {name}\n")
  print("| category | prompts | answer tokens | " + " | ".join(POLICIES) + " |")
  print("|---|---|---|" + "---|" * len(POLICIES))
  for category, rows in results.items():
    cells = []
    for policy in POLICIES:
      v, se = bootstrap(rows, policy)
      cells.append(f"{v:.3f} ± {se:.3f}")
    print(f"| {category} | {len(rows)} | {sum(r['tokens'] for r in rows)} | "
          + " | ".join(cells) + " |")
  print("\nGain over N (paired bootstrap standard error)\n")
  print("| category | " + " | ".join(POLICIES[1:]) + " | N's rounds with the first draft"
        " rejected | of those, P / G accept ≥ 1 |" + (" engine sd τ |" if engine_tau else ""))
  print("|---|" + "---|" * (len(POLICIES) + 1) + ("---|" if engine_tau else ""))
  for category, rows in results.items():
    cells = [f"{v:+.3f} ± {se:.3f}" for v, se in
             (bootstrap(rows, p, base="N") for p in POLICIES[1:])]
    fails = sum(r["fails"] for r in rows)
    rounds = sum(r["N"][1] for r in rows)
    rescued = " / ".join(f"{sum(r[f'rescued_{x}'] for r in rows) / max(fails, 1):.1%}"
                         for x in ("P", "G"))
    extra = f" {engine_tau[category]:.3f} |" if engine_tau else ""
    print(f"| {category} | " + " | ".join(cells) + f" | {fails} of {rounds}"
          f" ({fails / max(rounds, 1):.1%}) | {rescued} |" + extra)
  return 0


if __name__ == "__main__":
  sys.exit(main())
