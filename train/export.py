"""Converts a drafter between our export format and the public Hugging Face layouts.

    python -m train.export --drafter runs/eagle3/export --out hf/eagle3 --format hf
    python -m train.export --drafter smollm2-135m-instruct-block --out hf/block --format hf
    python -m train.export --drafter HF_DIR --target TARGET --out ours/eagle3   # HF -> ours

--format hf writes config.json + model.safetensors in the public layout of the
drafter's kind (SpecForge's EAGLE-3, z-lab's DFlash, DeepSpec's DSpark, Domino's;
servable by SGLang / vLLM); --format dloop (default) writes our own export
(drafter.json + arrays/). The target defaults to the one our export names. See
docs/checkpoint_formats.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


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
  return p.parse_args(argv)


def _default_target(drafter: str) -> str | None:
  """The target name recorded with a drafter (our drafter.json, or our key in config.json)."""
  from dloop_jax.drafters import hf_format  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top

  if hf_format.is_hf_dir(drafter):
    with open(os.path.join(drafter, hf_format.CONFIG_FILE)) as f:
      return (json.load(f).get(hf_format.META_KEY) or {}).get("target") or None
  return drafter_io.read_info(drafter_io.resolve(drafter)).get("target", {}).get("name") or None


def main(argv=None) -> int:
  args = _parse(argv)
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.registry import load_target  # pylint: disable=g-import-not-at-top

  try:
    target_name = args.target or _default_target(args.drafter)
    if not target_name:
      raise DLoopError(f"{args.drafter} does not name its target; pass --target.")
    target = load_target(target_name)
    drafter = drafter_io.load_drafter(args.drafter, target=target.model)
    out = drafter_io.export_drafter(drafter, args.out, target_name=target.name,
                                    format=args.format)
  except (DLoopError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out} ({args.format})", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
