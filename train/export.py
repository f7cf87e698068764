"""Converts a drafter between our export format and the public Hugging Face layouts.

    python -m train.export --drafter runs/eagle3/export --out hf/eagle3 --format hf
    python -m train.export --drafter smollm2-135m-instruct-block --out hf/block --format hf
    python -m train.export --drafter HF_DIR --target TARGET --out ours/eagle3   # HF -> ours
    python -m train.export --drafter smollm2-135m-instruct-block --out ours/block16k \
        --draft-vocab-size 16384 --token-counts DATASET   # draft the 16,384 commonest tokens
    python -m train.export --drafter runs/block/export --out ours/block_int8 --weights int8

--format hf writes config.json + model.safetensors in the public layout of the
drafter's kind (SpecForge's EAGLE-3, z-lab's DFlash, DeepSpec's DSpark, Domino's;
servable by SGLang / vLLM); --format dloop (default) writes our own export
(drafter.json + arrays/). The target defaults to the one our export names. See
docs/checkpoint_formats.md.

--draft-vocab-size restricts a full-vocabulary drafter whose head is the
target's (block, DSpark, Domino) to the most frequent response tokens of a
dataset built by `python -m train.data` (--token-counts: its directory): the
trained weights are kept and a drafting stage reads that many head rows instead
of the whole vocabulary's, and as many rows of DSpark's Markov head or Domino's
correction (`dloop_jax.drafters.with_draft_vocab`). This is how a DSpark or
Domino drafter gets a draft vocabulary: they train over the full one. The
public layouts hold no draft vocabulary: with --format hf a restricted DSpark
or Domino drafter is refused, a restricted block drafter is written over the
whole head (with a warning).

--weights int8 stores the weight matrices as int8 groups with a float32 scale
each (about half of bfloat16's bytes; loaded back as bfloat16): the storage of
the shipped drafters. Converting our export to our format keeps its training
metrics, provenance and shipping rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--drafter", required=True,
                 help="shipped drafter name, our export directory, training workdir, or an"
                      " EAGLE-3 / DFlash / DSpark / Domino Hugging Face directory")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--format", choices=("dloop", "hf"), default="dloop",
                 help="dloop: our export (drafter.json + arrays/); hf: config.json +"
                      " model.safetensors (EAGLE-3 / DFlash / DSpark / Domino layout)")
  p.add_argument("--target", default=None,
                 help="target the drafter belongs to: registry name, .gguf or HF directory"
                      " (default: the target our export names)")
  p.add_argument("--draft-vocab-size", type=int, default=0,
                 help="restrict the drafter to this many draft ids: the most frequent response"
                      " tokens of --token-counts (0: keep its vocabulary)")
  p.add_argument("--token-counts", default=None,
                 help="dataset directory (python -m train.data) whose training responses'"
                      " token counts choose the draft vocabulary")
  p.add_argument("--weights", choices=("bfloat16", "int8"), default="bfloat16",
                 help="--format dloop: weight storage (int8: matrices as int8 groups with a"
                      " scale each, loaded back as bfloat16)")
  return p.parse_args(argv)


def _default_target(drafter: str) -> str | None:
  """The target name recorded with a drafter (our drafter.json, or our key in config.json)."""
  from dloop_jax.drafters import hf_format  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top

  if drafter_io.is_hf_dir(drafter):
    with open(os.path.join(drafter, hf_format.CONFIG_FILE)) as f:
      return (json.load(f).get(hf_format.META_KEY) or {}).get("target") or None
  return drafter_io.read_info(drafter_io.resolve(drafter)).get("target", {}).get("name") or None


def _keep_shipping(path: str, source: dict) -> None:
  """Writes a shipped drafter's name and rank (`shipped_drafters_for`'s order) into the new
  export."""
  from dloop_jax import json_files  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top

  info_path = os.path.join(path, drafter_io.INFO_FILE)
  with open(info_path) as f:
    info = json.load(f)
  info.update({k: source[k] for k in ("name", "rank")})
  json_files.write_json(info_path, info, sort_keys=True)


def main(argv=None) -> int:
  args = _parse(argv)
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.registry import load_target  # pylint: disable=g-import-not-at-top

  try:
    if bool(args.draft_vocab_size) != bool(args.token_counts):
      raise DLoopError("--draft-vocab-size and --token-counts go together: the draft vocabulary"
                       " is the most frequent tokens of that dataset's responses.")
    target_name = args.target or _default_target(args.drafter)
    if not target_name:
      raise DLoopError(f"{args.drafter} does not name its target; pass --target.")
    target = load_target(target_name, dtype="float32")
    drafter = drafter_io.load_drafter(args.drafter, target=target.model)
    ours = not drafter_io.is_hf_dir(args.drafter)
    info = drafter_io.read_info(drafter_io.resolve(args.drafter)) if ours else {}
    metrics, extra = info.get("metrics"), info.get("extra")
    if args.draft_vocab_size:
      from dloop_jax.data import pipeline  # pylint: disable=g-import-not-at-top
      from dloop_jax.drafters import with_draft_vocab  # pylint: disable=g-import-not-at-top
      counts = pipeline.token_counts(args.token_counts,
                                     vocab_size=int(target.model.config.vocab_size))
      drafter = with_draft_vocab(drafter, counts, size=args.draft_vocab_size, target=target.model)
      kept = counts[np.asarray(drafter.d2t[...])].sum() / max(int(counts.sum()), 1)
      print(f"draft vocabulary: the {args.draft_vocab_size} most frequent of {int(counts.sum())}"
            f" response tokens ({kept:.2%} of them)", file=sys.stderr)
      # The dataset by its last two path components (name / version), not a machine's path.
      dataset = "/".join(os.path.normpath(args.token_counts).split(os.sep)[-2:])
      extra = dict(info.get("extra") or {}, draft_vocab={
          "size": args.draft_vocab_size, "counted_from": dataset,
          "response_tokens": int(counts.sum()), "share_of_response_tokens": float(kept)})
    out = drafter_io.export_drafter(drafter, args.out, target_name=target.name,
                                    format=args.format, metrics=metrics, extra=extra,
                                    weights=args.weights)
    if args.format == "dloop" and "rank" in info:
      _keep_shipping(out, info)
  except (DLoopError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out} ({args.format})", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
