"""Defaults: backend profiles, the decoding shape they give, and the command line's precision."""

from __future__ import annotations

import argparse
import json
import re
import types

import jax.numpy as jnp
import pytest

from dloop_jax import profiles
from dloop_jax.decoding import arguments
from dloop_jax.errors import ConfigError
from infer.__main__ import _parse, _precision


def _target(weights=jnp.float32, dtype=jnp.float32):
  return types.SimpleNamespace(weight_dtype=jnp.dtype(weights), dtype=jnp.dtype(dtype))


DRAFTER = types.SimpleNamespace(block_size=4)
BF16 = _target(jnp.bfloat16)


def _shape(target, mode, profile="cpu", **options):
  kwargs = dict(block_size=None, max_stages=None, schedule=None, fixed_width=None,
                tree_budget=0)
  kwargs.update(options)
  got = arguments.resolve_shape(target=target, mode=mode,
                                drafter=DRAFTER if mode != "ar" else None, profile=profile,
                                **kwargs)
  return got.fixed_width, got.block_size, got.max_stages, got.schedule


@pytest.mark.parametrize("mode,options,want", [
    # A 16-bit target at the profile's width; dloop fits it with 2 stages of 2.
    ("dloop", {}, (5, 2, 2, "off")),
    ("sd", {}, (5, 4, 1, "off")),  # the drafter's gamma fits 5
    ("ar", {}, (5, None, 3, "off")),  # ar at the same width: the same tokens
    # The user's gamma / S_max widen the width, in every mode alike.
    ("dloop", {"max_stages": 1}, (5, 4, 1, "off")),
    ("dloop", {"block_size": 4}, (13, 4, 3, "off")),
    ("ar", {"block_size": 4}, (13, 4, 3, "off")),
    ("dloop", {"block_size": 4, "max_stages": 2}, (9, 4, 2, "off")),
    ("ar", {"block_size": 4, "max_stages": 2}, (9, 4, 2, "off")),
    # Free widths where asked for: trees, an explicit cost schedule, width 0.
    ("dloop", {"tree_budget": 8}, (0, 4, 3, "off")),
    ("dloop", {"schedule": "cost"}, (0, 4, 3, "cost")),
    ("dloop", {"fixed_width": 0}, (0, 4, 3, "cost")),
    ("dloop", {"fixed_width": 9, "block_size": 4, "max_stages": 2}, (9, 4, 2, "off")),
])
def test_decoding_shape_of_a_16_bit_target(mode, options, want):
  assert _shape(BF16, mode, **options) == want


def test_accelerator_profiles_run_16_bit_targets_at_their_own_width():
  assert _shape(BF16, "dloop", profile="gpu") == (16, 4, 3, "off")
  assert _shape(BF16, "ar", profile="tpu") == (16, None, 3, "off")
  assert _shape(_target(jnp.bfloat16, jnp.bfloat16), "sd", profile="gpu") == (16, 4, 1, "off")


def test_f32_targets_run_at_free_widths():
  assert _shape(_target(), "dloop") == (0, 4, 3, "cost")
  assert _shape(_target(), "dloop", profile="gpu") == (0, 4, 3, "cost")
  assert _shape(_target(), "dloop", tree_budget=8) == (0, 4, 3, "off")


@pytest.mark.parametrize("options,match", [
    ({"tree_budget": 8, "fixed_width": 0}, "tree_budget=8 with a 16-bit target"),
    ({"fixed_width": 0, "tree_budget": 0}, "Free verification widths"),
])
def test_16_bit_targets_at_free_widths_are_refused(options, match):
  with pytest.raises(ConfigError, match=match):
    arguments.validate_exactness(target=BF16, mode="dloop", allow_inexact=False, **options)
  for mode, target, allow in [("ar", BF16, False), ("dloop", BF16, True),
                              ("dloop", _target(), False)]:
    arguments.validate_exactness(target=target, mode=mode, allow_inexact=allow, **options)


def test_profiles_resolve_by_name_backend_and_environment(monkeypatch):
  assert profiles.resolve("gpu").dtype == "bfloat16"
  assert profiles.resolve("tpu").weights == "bf16"
  # Attention kernels (`models.attention_kernels`): cuDNN / Pallas GPU, Pallas TPU, XLA.
  assert [profiles.resolve(p).attention_impl for p in ("gpu", "tpu", "cpu")] == [
      "cudnn", "pallas_tpu", "xla"]
  cpu = profiles.resolve("cpu")
  assert cpu.dtype == "float32"
  assert cpu.weights == ("bf16" if profiles.cpu_has_amx() else "f32")
  monkeypatch.delenv("DLOOP_PROFILE", raising=False)
  assert profiles.resolve().name == "cpu"  # the tests run on the CPU backend
  monkeypatch.setenv("DLOOP_PROFILE", "gpu")
  assert profiles.resolve().name == "gpu"
  with pytest.raises(ConfigError, match="profile must be one of"):
    profiles.resolve("npu")


def test_the_cpu_profile_takes_the_storage_this_machine_measured_faster(monkeypatch, tmp_path):
  monkeypatch.setenv("DLOOP_CACHE_DIR", str(tmp_path))
  assert profiles.measured_cpu_weights() is None  # not measured: the AMX flag decides
  assert "not measured" in profiles.resolve("cpu").why
  # The 5-token forward decides, not the one-token step: an AMD EPYC without
  # AMX measured f32 28.6 / bf16 34.5 ms at width 1 and 44.0 / 37.8 ms at
  # width 5; Intel AMX machines bf16 cheaper at both.
  for step_cost, width_cost, want in [
      ({"f32": 28.6, "bf16": 34.5}, {"f32": 44.0, "bf16": 37.8}, "bf16"),
      ({"f32": 25.0, "bf16": 32.5}, {"f32": 30.0, "bf16": 36.0}, "f32"),
      ({"f32": 25.0, "bf16": 17.3}, {"f32": 40.0, "bf16": 19.0}, "bf16")]:
    path = profiles.record_cpu_weights(step_cost, width_cost=width_cost)
    cpu = profiles.resolve("cpu")
    assert cpu.weights == want and "measured on this CPU" in cpu.why
    assert f"{width_cost['bf16']:.3g}" in cpu.why
    assert profiles.precision("cpu") == ("float32", want)
  # A record of another machine (or a damaged one) is not this machine's measurement.
  with open(path) as f:
    record = json.load(f)
  record["machine"]["processor"] = "another CPU"
  with open(path, "w") as f:
    json.dump(record, f)
  assert profiles.measured_cpu_weights() is None
  with open(path, "w") as f:
    f.write("{")
  assert profiles.measured_cpu_weights() is None
  assert profiles.resolve("cpu").weights == ("bf16" if profiles.cpu_has_amx() else "f32")
  with pytest.raises(ConfigError, match="positive"):
    profiles.record_cpu_weights({"f32": 1.0}, width_cost={"f32": 1.0, "bf16": 1.0})
  with pytest.raises(ConfigError, match="width_cost needs positive"):
    profiles.record_cpu_weights({"f32": 1.0, "bf16": 1.0}, width_cost={"f32": 0.0, "bf16": 1.0})
  # A record of the older rule (one-token steps only) is measured again.
  record = dict(machine=profiles._this_cpu(), weights="f32",
                step_cost={"f32": 1.0, "bf16": 2.0})
  with open(path, "w") as f:
    json.dump(record, f)
  assert profiles.measured_cpu_weights() is None


@pytest.mark.parametrize("profile,given,want", [
    ("gpu", {}, ("bfloat16", "bf16")),
    ("gpu", {"weights": "f32"}, ("float32", "f32")),
    ("gpu", {"weights": "bf16"}, ("bfloat16", "bf16")),
    ("cpu", {"weights": "bf16"}, ("float32", "bf16")),
    ("gpu", {"dtype": "float32"}, ("float32", None)),
])
def test_precision_fills_what_is_not_given(profile, given, want):
  assert profiles.precision(profile, **given) == want


@pytest.mark.parametrize("argv,want", [
    (["--profile", "gpu"], (None, None)),  # the profile's
    (["--profile", "gpu", "--tree-budget", "8"], ("float32", "f32")),  # exact trees
    (["--profile", "gpu", "--schedule", "cost"], ("float32", "f32")),
    (["--profile", "gpu", "--tree-budget", "8", "--weights", "bf16"], (None, "bf16")),
    (["--profile", "gpu", "--tree-budget", "8", "--allow-inexact"], (None, None)),
])
def test_command_line_precision(argv, want):
  assert _precision(_parse(argv)) == want


@pytest.mark.parametrize("width,gamma,max_stages,want", [
    (5, 4, 3, (2, 2)), (9, 4, 3, (4, 2)), (13, 4, 3, (4, 3)), (13, 4, 2, (4, 2)),
    (3, 4, 3, (1, 2)), (7, 2, 3, (2, 3)), (17, 8, 3, (8, 2)),
])
def test_loop_shape_for_width(width, gamma, max_stages, want):
  got = arguments.loop_shape_for_width(width, drafter_block_size=gamma, max_stages=max_stages)
  assert got == want
  assert arguments.full_verification_width(mode="dloop", block_size=got[0],
                                           max_stages=got[1]) <= width


def test_loop_shape_for_a_width_too_narrow():
  with pytest.raises(ConfigError, match="no room for two drafting stages"):
    arguments.loop_shape_for_width(2, drafter_block_size=4, max_stages=3)


def _command_args(command: str, argv: list[str]):
  # pylint: disable=g-import-not-at-top
  if command == "infer":
    return _parse(argv)
  if command == "infer.bench":
    from infer.bench import __main__ as bench_main
    return bench_main._parse(argv)
  from train import evaluate
  return evaluate._parse(["--drafters", "d"] + argv)


@pytest.mark.parametrize("command", ["infer", "infer.bench", "train.evaluate"])
def test_the_command_lines_restate_no_decoding_default(command):
  """Every decoding flag defaults to None: a command run without one decodes with
  DecodingConfig's own defaults (train.evaluate: the trainer's evaluation's)."""
  from dloop_jax.decoding import DecodingConfig  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import config as config_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import flags  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import engine_eval  # pylint: disable=g-import-not-at-top
  args = _command_args(command, [])
  names = config_lib.FIELDS | set(flags.SAMPLING_FLAGS)
  present = {k: v for k, v in vars(args).items() if k in names}
  assert len(present) >= 6 and set(present.values()) == {None}, present
  base = engine_eval.EVAL_DECODING if command == "train.evaluate" else DecodingConfig()
  assert flags.config(args, base=base) == base
  if command == "train.evaluate":
    assert args.decoding == engine_eval.EVAL_DECODING
  # A flag given sets its field, nothing else.
  args = _command_args(command, ["--gate", "-1.5", "--max-stages", "2"])
  assert flags.config(args, base=base) == base.replace(gate=-1.5, max_stages=2)


def test_a_bad_decoding_flag_is_named_before_anything_loads(capsys):
  from dloop_jax.decoding import DecodingConfig  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import flags  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit):
    _command_args("train.evaluate", ["--max-stages", "0"])
  assert "--max-stages (S_max) must be an int >= 1, got 0" in capsys.readouterr().err
  with pytest.raises(ConfigError, match=r"^--tree-budget must be an int >= 0 .* got -1\.$"):
    flags.check(DecodingConfig(mode="sd", tree_budget=-1))
  with pytest.raises(ConfigError, match="--lookup-min-match must be an int in 1..3"):
    flags.check(DecodingConfig(mode="sd", lookup_min_match=0))


@pytest.mark.real_model
def test_a_limit_past_the_context_window_fails_before_the_target_loads(capsys, monkeypatch):
  """The target's config is read from its metadata (no weights) and the limit checked first."""
  from dloop_jax.models import registry  # pylint: disable=g-import-not-at-top
  import infer.__main__ as infer_main  # pylint: disable=g-import-not-at-top

  def no_load(*args, **kwargs):
    raise AssertionError("the target was loaded")

  monkeypatch.setattr(registry, "load_target", no_load)
  config = registry.read_config("smollm2-135m-instruct")
  assert (config.num_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
  context = config.max_position_embeddings
  assert infer_main.main(["--max-new-tokens", str(context), "--mode", "ar"]) == 2
  err = capsys.readouterr().err
  assert f"--max-new-tokens {context} leaves no room for a prompt in the context window of" \
      f" {context} tokens of smollm2-135m-instruct" in err


def test_decoding_flags_parse_into_the_config_and_name_its_defaults(capsys):
  from dloop_jax.decoding import DecodingConfig  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import flags  # pylint: disable=g-import-not-at-top
  args = _parse(["--temperature", "0.7", "--top-k", "5", "--lookup", "off", "--allow-inexact",
                 "--fixed-width", "0"])
  got = flags.config(args, mode="sd")
  assert got == DecodingConfig(mode="sd", lookup="off", allow_inexact=True, fixed_width=0,
                               sampling=DecodingConfig().sampling.__class__(temperature=0.7,
                                                                            top_k=5))
  assert flags.config(_parse(["--gate", "auto"])).gate == "auto"
  assert flags.config(_parse(["--gate", "-2"])).gate == -2.0
  with pytest.raises(SystemExit):
    _parse(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "DLoop's confidence gate: a number g" in text
  assert f"here) (default: {DecodingConfig().gate})" in text
  assert f"(default: {DecodingConfig().width_tolerance})" in text
  assert set(flags.FLAGS) - {"mode"} <= {  # python -m infer takes every field as a flag
      a.replace("-", "_") for a in re.findall(r"--([a-z-]+)", text)}
  with pytest.raises(ValueError, match="No decoding flag"):
    flags.add(argparse.ArgumentParser(), ["sampling"])
