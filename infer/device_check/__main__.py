"""`python -m infer.device_check`: is the engine correct on this device, and how fast is it?

    python -m infer.device_check --out check_out                  # a GPU / TPU, minutes
    python -m infer.device_check --preset tiny --out check_tiny   # any CPU, under a minute

On the first JAX device, with random weights (no checkpoint, no network):

  correctness   greedy ar = sd = dloop at batch 1 and 32: bf16 weights and
                compute at one fixed width (bit for bit), f32 weights at free
                widths and with a draft tree (near-tie rule); a sampling run
                at temperature 1 (runs, ids in range, statistics consistent);
  speed         ms per ar step and per dloop round inside the decode loop,
                against the isolated forwards (`infer.profile`'s costs);
  prefill       tokens/s at 1k / 8k / 32k tokens (tiny: 64 / 256),
                lengths past the context or the device's memory skipped;
  attention     prefill at 8k / 32k through cuDNN flash attention against
                XLA's path (off a GPU, XLA's dot_product_attention stands in
                for cuDNN): tokens/s and the largest |difference| of the logits;
  long cache    ms per decode step (width 1) after 8k / 32k prompt tokens;
  loop copies   cache copies inside the loops of the optimized decode
                programs (should be 0);
  int8          int8 weights in the accelerator profiles' weight-only form,
                at the first batch size: whether the compiled forward reads
                every int8 matrix inside its product (HLO, widths 1 and W),
                its ms per forward against bf16's, and greedy ar = sd = dloop
                at the fixed width, bit for bit (`quantized`);
  memory        the device's peak bytes in use (n/a where the backend has
                no statistics); compile seconds of every program.

Writes DIR/results.json and DIR/summary.md (after every section, so an
interrupted run keeps what it measured) and keeps JAX's compilation cache in
DIR/jax_cache (a second run compiles little). Progress goes to stderr, the
verdict (PASS / FAIL per check) to stdout; the exit status is 1 when a check
fails, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from infer.device_check.plans import PLANS, TINY_XLA_FLAGS


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.device_check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="device_check_out", help="output directory")
  p.add_argument("--preset", default="default", help=f"one of {', '.join(PLANS)}")
  p.add_argument("--set", dest="overrides", default=None,
                 help="target fields field=value,... (default: the preset's, e.g. num_layers=4)")
  p.add_argument("--batches", default=None, help="batch sizes, e.g. 1,32 (default: 1,32)")
  p.add_argument("--prefill-lengths", default=None,
                 help="prompt lengths of the prefill measurement ('' for none)")
  p.add_argument("--f32-precision", default="highest", choices=("highest", "default"),
                 help="matmul precision of the f32 runs (default: highest; 'default' lets a"
                      " GPU use TF32 and a TPU bf16 passes, outside the f32 near-tie bound)")
  return p.parse_args(argv)


def _ints(text: str, what: str) -> tuple[int, ...]:
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    values = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    values = (0,)
  if any(v < 1 for v in values):
    raise ConfigError(f"{what} takes integers >= 1 separated by commas, got {text!r}.")
  return values


def run(args, log) -> dict:
  """The whole check; returns the result (also written to args.out). Raises DLoopError on bad
  input."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from infer.device_check import (  # pylint: disable=g-import-not-at-top
      checks, kernels, quantized, report, speed)
  from infer.profile import measure, presets  # pylint: disable=g-import-not-at-top

  if args.preset not in PLANS:
    raise ConfigError(f"Unknown preset {args.preset!r}; known: {', '.join(PLANS)}.")
  plan = PLANS[args.preset]
  overrides = plan.overrides if args.overrides is None else args.overrides
  config, _ = presets.preset_config(plan.base, overrides)
  batches = plan.batches if args.batches is None else _ints(args.batches, "--batches")
  lengths = (plan.prefill_lengths if args.prefill_lengths is None
             else _ints(args.prefill_lengths, "--prefill-lengths"))
  shape = plan.shape
  if shape.prompt_length + shape.long_tokens + shape.width > config.max_position_embeddings:
    raise ConfigError(f"The check's prompts and outputs need {shape.prompt_length}"
                      f" + {shape.long_tokens} + {shape.width} positions; the context window is"
                      f" {config.max_position_embeddings}.")
  label = f"{plan.base}" + (f" with {overrides}" if overrides else "")
  need = presets.check_fits(config, dtype=jnp.float32, weights=jnp.float32,
                            batch_size=max(batches), capacity=costs_capacity(config),
                            available=presets.device_memory_bytes(), preset=label)
  device = jax.devices()[0]
  log(f"{label}: {config.num_params() / 1e6:,.1f}M parameters (random), f32 copy about"
      f" {need['total'] / 2 ** 30:.1f} GiB and a bf16 one, on {device.device_kind}"
      f" ({jax.default_backend()}); batches {list(batches)}")

  result = dict(
      preset=args.preset, drafter=plan.drafter, f32_matmul_precision=args.f32_precision,
      device=dict(backend=jax.default_backend(), device_kind=device.device_kind,
                  count=jax.device_count(), jax=jax.__version__),
      target=dict(label=label, base=plan.base, overrides=overrides,
                  params=int(config.num_params()), shape=presets.summary(config),
                  weights="random: normal(0.02) matrices, unit norms (infer.profile)"),
      shape=dict(dataclasses.asdict(shape), width=shape.width, short_tokens=plan.short_tokens,
                 batches=list(batches)),
      correctness={}, elapsed_s=0.0)
  start = time.perf_counter()

  def save():
    result["elapsed_s"] = time.perf_counter() - start
    report.write(args.out, result)

  def built(what, fn):
    t0 = time.perf_counter()
    value = fn()
    jax.block_until_ready(jax.tree.leaves(value)[:1])
    log(f"built {what} in {time.perf_counter() - t0:.1f} s")
    return value

  def count_copies(label, *, target, prompts, programs, max_new_tokens):
    copies = result.setdefault("loop_copies", {})
    copies[label] = checks.guarded(lambda: kernels.copies(
        target=target, prompts=prompts, programs=programs, max_new_tokens=max_new_tokens))
    e = copies[label]
    log(f"cache copies in the loops, {label}: " + (
        f"ERROR {e['error']}" if "error" in e else
        ", ".join(f"{name} {c['count']}" for name, c in e.items())))
    save()

  def batch_prompts(b):
    return checks.prompts(batch_size=b, length=shape.prompt_length, vocab_size=config.vocab_size,
                          seed=b)

  def verdict_of(entry):
    return "PASS" if entry.get("ok") else "FAIL" + (f" ({entry['error']})" if "error" in entry
                                                    else "")

  # ------------------------------------ bf16: fixed-width greedy, speed, sampling
  bf16 = built("the bf16 target", lambda: presets.random_target(
      config, dtype=jnp.bfloat16, weights=jnp.bfloat16))
  result["target"]["attention_impl"] = getattr(bf16, "attention_impl", None)
  drafter16 = built(f"its {plan.drafter} drafter", lambda: measure.random_drafter(
      plan.drafter, target=bf16, block_size=shape.block_size))
  fixed, timings = {}, {}
  result["correctness"]["fixed_bf16"], result["speed"] = fixed, timings
  for b in batches:
    prompts = batch_prompts(b)
    t0 = time.perf_counter()
    runs = {}

    def fixed_check(prompts=prompts, runs=runs):
      runs.update(checks.greedy_runs(target=bf16, drafter=drafter16, prompts=prompts,
                                     shape=shape, kind="fixed"))
      return checks.compare_runs(runs, target=bf16, prompts=prompts, exact=True,
                                 max_new_tokens=shape.long_tokens, fixed_width=shape.width)

    fixed[str(b)] = checks.guarded(fixed_check)
    log(f"greedy fixed width {shape.width}, bf16, batch {b}: ar / sd / dloop"
        f" {verdict_of(fixed[str(b)])} ({time.perf_counter() - t0:.1f} s)")
    save()
    if b == batches[0]:
      count_copies(f"fixed width {shape.width}, bf16, batch {b}", target=bf16, prompts=prompts,
                   programs=checks.run_plans(kind="fixed", shape=shape, drafter=drafter16),
                   max_new_tokens=shape.long_tokens)
    t0 = time.perf_counter()
    timings[str(b)] = checks.guarded(lambda prompts=prompts, runs=runs: speed.loop_speed(
        target=bf16, drafter=drafter16, prompts=prompts, plan=plan, runs=runs))
    e = timings[str(b)]
    if "error" in e:
      log(f"speed, batch {b}: ERROR {e['error']}")
    else:
      log(f"speed, batch {b}: ar step {_ms(e['ar'])} (isolated {e['ar']['isolated_ms']:.3f}),"
          f" dloop round {_ms(e['dloop'])} (modeled {_ms_value(e['dloop']['isolated_ms'])})"
          f" ({time.perf_counter() - t0:.1f} s)")
    save()

  t0 = time.perf_counter()
  result["sampling"] = checks.guarded(lambda: checks.sampling_smoke(
      target=bf16, drafter=drafter16, prompts=batch_prompts(max(batches)), shape=shape))
  log(f"sampling, batch {max(batches)}: {verdict_of(result['sampling'])}"
      f" ({time.perf_counter() - t0:.1f} s)")
  save()

  # ------------------------------------------ f32: free widths and a draft tree
  with jax.default_matmul_precision(args.f32_precision):
    try:
      f32 = built("the f32 target", lambda: presets.random_target(
          config, dtype=jnp.float32, weights=jnp.float32))
      drafter32 = built(f"its {plan.drafter} drafter", lambda: measure.random_drafter(
          plan.drafter, target=f32, block_size=shape.block_size))
    except Exception as e:  # pylint: disable=broad-except
      if not presets.is_out_of_memory(e):
        raise
      error = checks.error_record(e)
      for name in ("free_f32", "tree_f32"):
        result["correctness"][name] = {str(b): error for b in batches}
      log(f"f32 target: {error['error']} (try --set num_layers=2)")
      f32 = None
    for kind, name in (("free", "free_f32"), ("tree", "tree_f32")):
      if f32 is None:
        break
      entries = result["correctness"].setdefault(name, {})
      for b in batches:
        prompts = batch_prompts(b)
        t0 = time.perf_counter()
        entries[str(b)] = checks.guarded(lambda kind=kind, prompts=prompts: checks.compare_runs(
            checks.greedy_runs(target=f32, drafter=drafter32, prompts=prompts, shape=shape,
                               kind=kind),
            target=f32, prompts=prompts, exact=False, max_new_tokens=shape.new_tokens))
        runs = " / ".join(entries[str(b)].get("runs", {})) or kind
        log(f"greedy {name}, batch {b}: {runs} {verdict_of(entries[str(b)])}"
            f" ({time.perf_counter() - t0:.1f} s)")
        save()
        if kind == "free" and b == batches[0]:
          # The free-width dloop verifies through a switch over its widths.
          count_copies(f"free widths, f32, batch {b}", target=f32, prompts=prompts,
                       programs=checks.run_plans(kind="free", shape=shape, drafter=drafter32),
                       max_new_tokens=shape.new_tokens)
    f32 = drafter32 = None  # frees the f32 copy before the prefill

  # ------------------------- int8: the accelerator profiles' weight-only products
  def int8_part(b):
    """The standard form on every backend (on a CPU the `cpu` profile would take the integer
    one), at batch `b`, with the bf16 target's drafter: what is compared is the int8 model's
    ar against its own sd / dloop, whatever the drafts."""
    try:
      int8 = built("the int8 target (weight-only products)", lambda: presets.random_target(
          config, dtype=jnp.bfloat16, weights=jnp.int8, cpu_kernels=False))
    except Exception as e:  # pylint: disable=broad-except
      error = checks.error_record(e)
      result["int8"], result["correctness"]["fixed_int8"] = error, {str(b): error}
      log(f"int8 target: {error['error']}")
      save()
      return
    t0 = time.perf_counter()
    result["int8"] = e = checks.guarded(lambda: quantized.check(
        target=int8, batch_size=b, width=shape.width, repeats=plan.repeats,
        bf16_costs=timings.get(str(b), {}).get("cost_ms"), out_dir=args.out, log=log))
    log(f"int8, batch {b}: " + (f"ERROR {e['error']}" if "error" in e else
                               f"{e['status']}; ms per forward, int8 / bf16: "
                               + ", ".join(f"width {w} {_ms_value(e['cost_ms'][w])} /"
                                           f" {_ms_value(e['bf16_cost_ms'][w])}"
                                           for w in e["cost_ms"]))
        + f" ({time.perf_counter() - t0:.1f} s)")
    save()
    prompts = batch_prompts(b)
    t0 = time.perf_counter()
    entry = checks.guarded(lambda: checks.compare_runs(
        checks.greedy_runs(target=int8, drafter=drafter16, prompts=prompts, shape=shape,
                           kind="fixed", max_new_tokens=shape.new_tokens),
        target=int8, prompts=prompts, exact=True, max_new_tokens=shape.new_tokens,
        fixed_width=shape.width))
    result["correctness"]["fixed_int8"] = {str(b): entry}
    log(f"greedy fixed width {shape.width}, int8, batch {b}: ar / sd / dloop {verdict_of(entry)}"
        f" ({time.perf_counter() - t0:.1f} s)")
    save()

  int8_part(batches[0])

  # --------------------------------------------------------------------- prefill
  t0 = time.perf_counter()
  try:
    result["prefill"] = speed.prefill(target=bf16, lengths=lengths, repeats=plan.repeats, log=log)
  except Exception as e:  # pylint: disable=broad-except
    result["prefill"] = [dict(length=0, error=checks.error_record(e)["error"])]
    log(f"prefill: ERROR {result['prefill'][0]['error']}")
  log(f"prefill done ({time.perf_counter() - t0:.1f} s)")
  save()

  # ----------------------------------------- attention, long cache, memory
  def entries(name, fn):
    t0 = time.perf_counter()
    try:
      result[name] = fn()
    except Exception as e:  # pylint: disable=broad-except
      result[name] = [checks.error_record(e)]
      log(f"{name}: ERROR {result[name][0]['error']}")
    log(f"{name} done ({time.perf_counter() - t0:.1f} s)")
    save()

  entries("attention", lambda: kernels.attention(
      target=bf16, lengths=plan.attention_lengths, repeats=plan.repeats,
      backend=jax.default_backend(), log=log))
  long_tokens, short_tokens = plan.long_steps
  entries("long_cache", lambda: kernels.long_cache(
      target=bf16, contexts=plan.long_contexts, long_tokens=long_tokens,
      short_tokens=short_tokens, repeats=plan.repeats, log=log))
  result["memory"] = kernels.peak_memory()
  log("peak device memory: " + (f"{result['memory']['peak_bytes'] / 2 ** 30:.2f} GiB"
                                if "peak_bytes" in result["memory"] else result["memory"]["n/a"]))
  save()
  return result


def costs_capacity(config) -> int:
  """Cache slots a check holds at most (the decode's 512-slot bucket, or the calibration's)."""
  return min(512, config.max_position_embeddings)


def _ms(entry: dict) -> str:
  return _ms_value(entry.get("ms_per_iteration"))


def _ms_value(value) -> str:
  return "–" if value is None else f"{value:.3f} ms"


def main(argv=None, *, compile_cache: bool = False) -> int:
  """Runs the check; 0 all passed, 1 a check failed, 2 bad arguments.

  compile_cache: keep JAX's persistent compilation cache in OUT/jax_cache
  (the command line does; callers in one process with their own cache
  settings, the tests, leave it off).
  """
  args = _parse(argv)
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from infer.device_check import report  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()

  def log(message: str) -> None:
    print(f"[device_check {time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr,
          flush=True)

  if args.preset == "tiny" and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = TINY_XLA_FLAGS  # read when the backend starts, below
  if compile_cache:
    import infer  # pylint: disable=g-import-not-at-top
    os.environ["DLOOP_JAX_CACHE"] = os.path.abspath(os.path.join(args.out, "jax_cache"))
    infer.enable_compilation_cache()
  try:
    result = run(args, log)
  except DLoopError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  line, ok = report.verdict(result)
  log(f"wrote {os.path.join(args.out, 'results.json')} and"
      f" {os.path.join(args.out, 'summary.md')}")
  print(line, flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(compile_cache=True))
