"""Puts a block drafter into DFlash's form: the target's whole head, a mask token.

    python scripts/tie_block_mask.py --drafter smollm2-135m-instruct-block \
        --mask-token-id 16 --out runs/smollm2_block_dflash_init

Keeps every backbone weight; drops the learned mask vector (the mask input
becomes the target's embedding of `--mask-token-id`) and the reduced draft
vocabulary (the head becomes the target's over the full vocabulary). The result
drafts worse until fine-tuned (e.g. `configs/smollm2_block.py:cpu10k_loop`, whose
drafter has this form, with `--config.init_from=` the output; how the first shipped
block drafter went through it: docs/archive/drafters_smollm2_history.md); it is then
expressible in the DFlash layout
(`python -m train.export --format hf`).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--drafter", required=True, help="block drafter: shipped name or export dir")
  p.add_argument("--mask-token-id", type=int, required=True,
                 help="token whose target embedding is the mask input (a reserved token)")
  p.add_argument("--out", required=True, help="export directory to write")
  args = p.parse_args(argv)

  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.registry import build_for_loading  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.registry import load_target  # pylint: disable=g-import-not-at-top

  info = drafter_io.read_info(drafter_io.resolve(args.drafter))
  target = load_target(info.get("target", {}).get("name") or "smollm2-135m-instruct")
  source = drafter_io.load_drafter(args.drafter, target=target.model)
  if source.spec.kind != "block":
    raise ConfigError(f"{args.drafter} is a {source.spec.kind!r} drafter; this converts block"
                      " drafters.")
  config = dict(source.drafter_config(), draft_vocab_size=0, mask_token_id=args.mask_token_id)
  drafter = build_for_loading(config, target=target.model)
  kept = [(k, v) for k, v in nnx.to_flat_state(nnx.state(source, nnx.Param))
          if k[0] != "mask_embed"]
  nnx.update(drafter, nnx.from_flat_state(kept))
  drafter_io.export_drafter(drafter, args.out, target_name=target.name,
                            extra={"converted_from": args.drafter})
  print(f"Wrote {args.out}: {args.drafter} with mask_token_id={args.mask_token_id} and the"
        " target's full-vocabulary head.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
