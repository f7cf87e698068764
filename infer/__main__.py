"""`python -m infer`: generate with a target model (and a drafter) from the command line.

    python -m infer --prompt "What is 2 + 2?"     # dloop with this machine's profile
    python -m infer --mode ar --prompt "..."      # the exact reference of the same options
    python -m infer --profile gpu               # an accelerator's defaults (runs on a CPU too)
    python -m infer --weights bf16              # every forward 5 tokens wide (cpu profile)
    python -m infer --weights f32 --fixed-width 0   # f32 weights, forwards as wide as needed
    python -m infer --prompts-file prompts.jsonl --json --max-new-tokens 128
    python -m infer --mode dloop --drafter PATH --block-size 4 --gate -0.75 --max-stages 2
    python -m infer --drafter HF_DIR    # an EAGLE-3 / DFlash / DSpark / Domino checkpoint (config.json + safetensors)
    python -m infer --schedule off      # verify every draft (default: only the prefix that pays)
    python -m infer --lookup off        # no prompt-lookup drafts (default: where the drafter is unsure)
    python -m infer --mode dloop --drafter PATH --tree-budget 8   # top-8 draft trees per stage
    python -m infer --dtype bfloat16    # bf16 compute (accelerators)
    python -m infer --mesh data=2,tensor=4 --prompts-file prompts.jsonl   # 8 devices
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings


def _precision(args) -> tuple[str | None, str | None]:
  """(dtype, weights) to load the target with; None: the profile's.

  Draft trees and --schedule cost verify at free widths, which reproduce
  --mode ar exactly only with f32 weights: unless --weights / --dtype say
  otherwise (or --allow-inexact), they load f32 weights.
  """
  from dloop_jax.decoding import arguments  # pylint: disable=g-import-not-at-top
  free_widths = arguments.asks_free_widths(fixed_width=args.fixed_width, schedule=args.schedule,
                                           tree_budget=args.tree_budget)
  if (args.dtype is None and args.weights is None and free_widths
      and not args.allow_inexact):
    from dloop_jax import profiles  # pylint: disable=g-import-not-at-top
    if profiles.resolve(args.profile).weights != "f32":
      print("note: free verification widths (--tree-budget, --schedule cost or --fixed-width"
            " 0) reproduce --mode ar exactly with f32 weights only: loading f32 weights"
            " (--weights bf16 --allow-inexact to keep 16-bit ones).", file=sys.stderr)
    return "float32", "f32"
  return args.dtype, args.weights


# The decoding options this command takes, named after `DecodingConfig`'s fields.
DECODING_FLAGS = ("mode", "profile", "block_size", "gate", "max_stages", "schedule",
                  "confidence", "tree_budget", "lookup", "lookup_min_match",
                  "lookup_max_probability", "draft_backoff", "fixed_width", "costs", "calibration",
                  "width_tolerance", "allow_inexact")


def _parse(argv):
  from dloop_jax.decoding import flags  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="python -m infer", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct",
                 help="registry name, .gguf path or Hugging Face model directory")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--prompt", help="a user message (chat template applied unless --raw)")
  src.add_argument("--prompts-file", help="JSONL file with a 'prompt' field per line")
  p.add_argument("--raw", action="store_true", help="do not apply the chat template")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--drafter", help="drafter name, exported drafter directory, or an EAGLE-3 /"
                                    " DFlash / DSpark / Domino checkpoint directory in its Hugging Face layout"
                                    " (default: the best drafter shipped for the target)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                 help="the target's compute dtype (activations, KV cache; logits and acceptance"
                      " stay f32). Default: the profile's (float32 on CPU, bfloat16 on"
                      " accelerators)")
  p.add_argument("--weights", choices=("f32", "bf16", "int8"), default=None,
                 help="storage of the target's weight matrices. Default: the profile's (bf16"
                      " on accelerators and CPUs with AMX, f32 on other CPUs; f32 with trees"
                      " and free widths); --dtype bfloat16 needs bf16 or int8; int8: quantized"
                      " at load, per output channel (docs/decoding.md, \"Weights\")")
  p.add_argument("--mesh", default=None,
                 help="decode on a device mesh, e.g. data=2,tensor=4: prompts in batches"
                      " of data rows, the target's weights and KV heads split over tensor"
                      " (docs/scaling.md)")
  p.add_argument("--json", action="store_true", help="one JSON object per prompt")
  decoding = p.add_argument_group("decoding (fields of dloop_jax.DecodingConfig)")
  flags.add(decoding, DECODING_FLAGS, sampling=True, help=dict(
      mode="ar, sd or dloop (default: dloop when a drafter is available for the target,"
           " else ar)"))
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _parse(argv)
  from infer import enable_compilation_cache  # pylint: disable=g-import-not-at-top
  enable_compilation_cache()

  from dloop_jax import prompt_files
  from dloop_jax.decoding import arguments
  from dloop_jax.decoding import config as config_lib
  from dloop_jax.decoding import flags
  from dloop_jax.decoding import generate
  from dloop_jax.errors import DLoopError, PromptTooLongError
  from dloop_jax.models.registry import load_target, read_config

  try:
    # The options alone first: a bad value fails before the target loads.
    flags.check(flags.config(args, mode=args.mode or "dloop"))
    arguments.validate_max_new_tokens(args.max_new_tokens)
    # Prompts first: a bad file fails before the target loads.
    if args.prompts_file:
      prompts = prompt_files.read_prompts(args.prompts_file)
    else:
      prompts = [args.prompt or "What is the capital of France?"]
    # The limit against the context window, from the target's metadata: before the load.
    context = read_config(args.target).max_position_embeddings
    if args.max_new_tokens >= context:
      raise PromptTooLongError(
          f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the context"
          f" window of {context} tokens of {args.target}; ask for fewer new tokens.")
    mesh = None
    if args.mesh:
      from dloop_jax.models import sharding  # pylint: disable=g-import-not-at-top
      mesh = sharding.inference_mesh(args.mesh)
    dtype, weights = _precision(args)
    target = load_target(args.target, dtype=dtype, weights=weights, mesh=mesh,
                         profile=args.profile)
    if mesh is not None:
      print(sharding.describe(target.config, target.model.layout), file=sys.stderr)
    tok = target.tokenizer
    drafter = None
    if args.mode != "ar":
      from dloop_jax.drafters import io as drafter_io
      # Without --drafter: the best drafter shipped for this target, if any.
      name = args.drafter or next(iter(drafter_io.shipped_drafters_for(target.config)), None)
      if name:
        drafter = drafter_io.load_drafter(name, target=target.model)
    mode = args.mode or ("dloop" if drafter is not None else "ar")
    if mode != "ar" and drafter is None:
      raise DLoopError(
          f"mode {mode!r} needs a drafter, and no drafter is available for target"
          f" {target.name!r} yet; pass --drafter PATH (an exported drafter, see docs/training.md)"
          " or use --mode ar.")
    if tok is None:
      raise DLoopError(f"Target {target.name!r} has no tokenizer files; add them to the model"
                       " directory (tokenizer.json / tokenizer_config.json).")
    stop = list(tok.stop_token_ids) if tok is not None else list(target.config.eos_token_ids)
    encoded = []
    for text in prompts:
      if args.raw or tok is None or not tok.has_chat_template:
        encoded.append(tok.encode(text))
      else:
        encoded.append(tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True))
    # ar takes the speculative modes' options too (they set its width), not their trees.
    speculative_only = dict(schedule=None, tree_budget=0) if mode == "ar" else {}
    config = flags.config(args, mode=mode, **speculative_only)
    # What runs: the resolution generate() makes too (a refusal stops here).
    looks_up = config_lib.resolve(config, target=target.model,
                                  drafter=drafter).lookup == "prompt"
    # One prompt per call; on a mesh, batches of one row per data shard (the
    # last padded with copies of its last prompt, whose outputs are dropped).
    rows_per_call = mesh.shape["data"] if mesh is not None else 1
    noted = set()
    for start in range(0, len(encoded), rows_per_call):
      batch = encoded[start:start + rows_per_call]
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(target.model, batch + [batch[-1]] * (rows_per_call - len(batch)),
                       max_new_tokens=args.max_new_tokens, drafter=drafter, config=config,
                       seed=args.seed, stop_tokens=stop)
      _note(caught, noted)
      for i, ids in enumerate(batch):
        _report(args, text=prompts[start + i], ids=ids, out=out, index=i, mode=mode,
                drafter=drafter, tok=tok, target=target.model, looks_up=looks_up)
  except (DLoopError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def _note(caught, noted: set) -> None:
  """The warnings of a generate() call: the assumed cost table as one line of its own
  (once), the others as Python shows them."""
  from dloop_jax.decoding import costs as costs_lib  # pylint: disable=g-import-not-at-top
  for w in caught:
    if issubclass(w.category, costs_lib.AssumedCostsWarning):
      if w.category not in noted:
        print(f"note: {w.message}", file=sys.stderr)
        noted.add(w.category)
    else:
      warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _report(args, *, text, ids, out, index, mode, drafter, tok, target, looks_up) -> None:
  """Prints one prompt's answer (and its statistics) from a `GenerationOutput` row."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import is_half  # pylint: disable=g-import-not-at-top
  fixed_width = out.fixed_width
  weights = "int8" if target.int8 else "bf16" if is_half(target.weight_dtype) else "f32"
  dtype = str(np.dtype(target.dtype))
  new = out.tokens[index]
  answer = tok.decode(new, skip_special_tokens=True)
  row = out.rows[index]
  if args.json:
    rec = dict(prompt=text, text=answer, prompt_ids=ids, output_ids=new,
               **row.as_dict(),  # the statistics (`RowStats`)
               seconds=out.seconds, compile_seconds=out.compile_seconds,
               tokens_per_second=row.new_tokens / out.seconds if out.seconds else 0.0,
               mode=mode, drafter=getattr(drafter, "name", None),
               schedule=out.schedule, tree_budget=args.tree_budget or None,
               dtype=dtype, weights=weights, fixed_width=fixed_width, mesh=args.mesh,
               attention_kernels=list(out.attention_kernels))
    if not looks_up:
      rec["lookup_rounds"] = None
    print(json.dumps(rec), flush=True)
  else:
    print(answer)
    tps = row.new_tokens / out.seconds if out.seconds else math.nan
    shape = (f"{mode}, {weights} weights" + (f", width {fixed_width}" if fixed_width else "")
             + (f", attention {' + '.join(out.attention_kernels)}" if out.attention_kernels
                else ""))
    print(f"[{shape}] {row.new_tokens} tokens in {out.seconds:.2f}s ({tps:.1f} tok/s),"
          f" compile {out.compile_seconds:.1f}s, target forwards {row.target_forwards}"
          + (f", tau {row.acceptance_length:.2f}, verified {row.verified}/{row.drafted}"
             f" drafts, {row.plain_rounds} plain rounds" if mode != "ar" else "")
          + (f", {row.lookup_rounds} lookup rounds" if looks_up else ""),
          file=sys.stderr)


if __name__ == "__main__":
  sys.exit(main())
