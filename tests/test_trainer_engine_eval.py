"""Engine evaluation during training: τ of `generate()` at checkpoints, the best step exported."""

from __future__ import annotations

import json
import os
import types

import pytest
from ml_collections import ConfigDict

import trainer_hooks
from dloop_jax.drafters import io as drafter_io
from dloop_jax.errors import ConfigError
from dloop_jax.training import config as config_lib
from dloop_jax.training import engine_eval
from dloop_jax.training import evaluation
from dloop_jax.training import hooks as hooks_lib
from dloop_jax.training import metrics_writer
from dloop_jax.training import trainer as trainer_lib


def _config(**overrides) -> ConfigDict:
  c = trainer_hooks.tiny_config(hooks="", **overrides)
  c.drafter = ConfigDict(dict(kind="eagle3", block_size=2))
  c.objective_cfg = ConfigDict(dict(ttt_steps=2, step_decay=0.8))
  c.optim.learning_rate, c.optim.warmup_steps = 3e-3, 1
  c.checkpoint.every_steps = 2
  c.eval.every_steps, c.eval.prompts, c.eval.num_prompts = 2, "random", 3
  c.eval.max_new_tokens = 12
  return c


def _evaluations(workdir: str) -> dict[int, dict]:
  with open(os.path.join(workdir, metrics_writer.METRICS_FILE)) as f:
    lines = [json.loads(line) for line in f]
  return {r["step"]: r for r in lines if "engine_tau_sd" in r}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Four steps evaluated every two, then resumed to eight."""
  workdir = str(tmp_path_factory.mktemp("engine_eval"))
  first = trainer_lib.train(_config(num_steps=4, export__enabled=False), workdir)
  first_best = drafter_io.read_info(os.path.join(workdir, evaluation.BEST_DIR))
  second = trainer_lib.train(_config(num_steps=8), workdir)
  return workdir, first, first_best, second


def test_engine_tau_is_logged_at_every_evaluation(run):
  workdir, first, _, second = run
  evals = _evaluations(workdir)
  assert sorted(evals) == [2, 4, 6, 8]
  for r in evals.values():
    # A round commits at least the target's token, at most every draft + 1.
    assert 1.0 <= r["engine_tau_sd"] <= 3.0 and 1.0 <= r["engine_tau_dloop"] <= 7.0, r
    assert r["engine_eval_s"] > 0 and 0.0 <= r["engine_multi_stage_dloop"] <= 1.0
  assert first.metrics["engine_tau_sd"] == evals[4]["engine_tau_sd"]
  assert second.metrics["engine_tau_dloop"] == evals[8]["engine_tau_dloop"]


def test_best_step_is_exported_and_survives_a_resume(run):
  workdir, _, first_best, _ = run
  evals = _evaluations(workdir)
  tau = {step: r["engine_tau_sd"] for step, r in evals.items()}
  best_early = max((2, 4), key=lambda s: (tau[s], -s))  # the first of equal scores is kept
  assert first_best["extra"]["step"] == best_early
  info = drafter_io.read_info(os.path.join(workdir, evaluation.BEST_DIR))
  best = max(sorted(tau), key=lambda s: (tau[s], -s))
  assert info["extra"]["step"] == best
  assert info["metrics"]["engine_tau_sd"] == tau[best]
  target = hooks_lib.default_build_target(_config().target).model
  assert drafter_io.load_drafter(os.path.join(workdir, evaluation.BEST_DIR), target=target)


def test_multi_stage_share_follows_the_gate(run):
  workdir, *_ = run
  target = hooks_lib.default_build_target(_config().target).model
  drafter = drafter_io.load_drafter(os.path.join(workdir, evaluation.BEST_DIR), target=target)
  prompts = ((5, 9, 11, 3), (7, 2, 30, 8, 1))
  share = {gate: engine_eval.EngineEval(
      prompts=prompts, max_new_tokens=12, modes=("dloop",),
      decoding=engine_eval.EVAL_DECODING.replace(gate=gate))(target, drafter)[
          "engine_multi_stage_dloop"] for gate in (float("inf"), float("-inf"))}
  # g = +inf: no round goes past its first stage; g = -inf: every round goes on while tokens
  # are left (the last rounds of a row may have room for one stage only).
  assert share[float("inf")] == 0.0 and share[float("-inf")] >= 0.5, share


def test_dloop_shape_fixed_width_schedule_and_lookup_reach_generate(run):
  from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
  workdir, *_ = run
  target = hooks_lib.default_build_target(_config().target).model
  drafter = drafter_io.load_drafter(os.path.join(workdir, evaluation.BEST_DIR), target=target)
  prompts = ((5, 9, 11, 3), (7, 2, 30, 8, 1))
  ev = engine_eval.EngineEval(prompts=prompts, max_new_tokens=12,
                              decoding=engine_eval.decoding(dict(
                                  gate=float("-inf"), block_size=1, max_stages=2,
                                  fixed_width=3)))
  got = ev(target, drafter)
  for mode, shape in (("sd", {}), ("dloop", dict(block_size=1, max_stages=2))):
    want = generate(target, [list(p) for p in prompts], max_new_tokens=12, mode=mode,
                    drafter=drafter, gate=float("-inf"), schedule="off", fixed_width=3,
                    lookup="off", **shape)
    assert got[f"engine_tau_{mode}"] == want.total.acceptance_length, mode
  # Every dloop round drafts two stages of one while tokens are left.
  assert got["engine_multi_stage_dloop"] >= 0.5
  tree = engine_eval.EngineEval(prompts=prompts, max_new_tokens=12, modes=("sd",),
                                decoding=engine_eval.decoding(dict(tree_budget=3)))(
                                    target, drafter)
  want = generate(target, [list(p) for p in prompts], max_new_tokens=12, mode="sd",
                  drafter=drafter, schedule="off", tree_budget=3)
  assert tree["engine_tau_sd"] == want.total.acceptance_length
  # The τ users get: the scheduler's choice, with prompt-lookup drafts.
  users = engine_eval.EngineEval(prompts=prompts, max_new_tokens=12, modes=("sd",),
                                 decoding=engine_eval.decoding(dict(
                                     schedule="cost", lookup="prompt")))(target, drafter)
  want = generate(target, [list(p) for p in prompts], max_new_tokens=12, mode="sd",
                  drafter=drafter, schedule="cost", lookup="prompt")
  assert users["engine_tau_sd"] == want.total.acceptance_length


class _Tokenizer:
  stop_token_ids = (2,)

  def apply_chat_template(self, messages, add_generation_prompt):
    assert add_generation_prompt
    return [1] + [3 + ord(ch) % 50 for ch in messages[0]["content"]] + [2]


def test_prompts_file_is_read_through_the_chat_template(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("\n".join(json.dumps({"prompt": p}) for p in ("hi", "x" * 40, "abc", "de")))
  target = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64,
                                                              vocab_size=64))
  c = config_lib.base_config().eval
  c.prompts, c.num_prompts, c.max_prompt_tokens, c.max_new_tokens = str(path), 2, 16, 8
  ev = engine_eval.from_config(c, target=target, tokenizer=_Tokenizer())
  # The 42-token prompt does not fit 16: the first two that do.
  assert ev.prompts == ((1, 7, 8, 2), (1, 50, 51, 52, 2)) and ev.stop_tokens == (2,)
  c.prompts = "bench"
  with pytest.raises(ConfigError, match="needs the target's tokenizer"):
    engine_eval.from_config(c, target=target, tokenizer=None)


def test_eval_decoding_takes_every_decoding_field_and_refuses_others():
  """`eval.decoding` sets any field of DecodingConfig over the evaluation's own choices; the
  trainer's config restates none of DecodingConfig's defaults."""
  from dloop_jax.decoding import config as decoding_config  # pylint: disable=g-import-not-at-top
  c = _config()
  assert dict(c.eval.decoding) == {}
  overrides = dict(mode="sd", block_size=2, gate=-1.25, max_stages=4, schedule="cost",
                   confidence="probability", tree_budget=0, fixed_width=7, draft_backoff=3,
                   costs="calibrate", calibration="table.json", width_tolerance=0.1,
                   lookup="prompt", lookup_min_match=3, lookup_max_probability=0.25, profile="gpu",
                   allow_inexact=False, sampling=engine_eval.EVAL_DECODING.sampling)
  assert set(overrides) == decoding_config.FIELDS  # every field, tried below
  for key, value in overrides.items():
    setattr(c.eval.decoding, key, value)
  config_lib.validate(c)
  got = engine_eval.decoding(c.eval.decoding)
  assert all(getattr(got, k) == v for k, v in overrides.items())
  target = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64,
                                                              vocab_size=64))
  ev = engine_eval.from_config(c.eval, target=target, tokenizer=None)
  assert ev.decoding == got and ev.config("dloop").mode == "dloop"
  # Unset fields keep the evaluation's choices, and those keep generate()'s defaults.
  assert engine_eval.decoding({}) == engine_eval.EVAL_DECODING
  assert engine_eval.EVAL_DECODING.gate == decoding_config.DecodingConfig().gate
  c = _config()
  c.eval.decoding.gamma = 3
  with pytest.raises(ConfigError, match=r"eval.decoding: Unknown decoding option\(s\) \['gamma'\]"):
    config_lib.validate(c)
  c = _config()
  c.eval.decoding.gate = float("nan")
  with pytest.raises(ConfigError, match="eval.decoding: gate must be a number"):
    config_lib.validate(c)


def test_bad_eval_settings_are_refused():
  c = _config()
  c.eval.keep_best = "engine_tau_tree"
  with pytest.raises(ConfigError, match="eval.keep_best='engine_tau_tree' is not measured"):
    config_lib.validate(c)
  c = _config()
  c.eval.modes = ("ar",)
  with pytest.raises(ConfigError, match="eval.modes must be"):
    config_lib.validate(c)


def test_throughput_counts_example_tokens_apart_from_padding(run):
  workdir, *_ = run
  with open(os.path.join(workdir, metrics_writer.METRICS_FILE)) as f:
    logged = [r for r in map(json.loads, f) if "tokens_per_s" in r]
  assert logged
  for r in logged:
    # One padded example per 32-position row (prompts of 4..8 tokens, answers up to 24).
    assert 0 < r["example_tokens_per_s"] < r["tokens_per_s"], r


def test_patience_stops_a_run_that_stopped_improving_and_it_stays_stopped(tmp_path):
  """With a learning rate of 1e-12 τ never improves on the first evaluation: the run stops after
  `patience` more evaluations, and resuming it trains no further."""
  workdir = str(tmp_path)
  c = _config(num_steps=40, export__enabled=False)
  c.optim.learning_rate, c.eval.patience = 1e-12, 2
  result = trainer_lib.train(c, workdir)
  assert result.stopped_early and result.step == 6, result.step
  assert sorted(_evaluations(workdir)) == [2, 4, 6]
  assert drafter_io.read_info(os.path.join(workdir, evaluation.BEST_DIR))["extra"]["step"] == 2
  again = trainer_lib.train(c, workdir)
  assert again.stopped_early and again.step == 6 and again.resumed_from == 6
  assert sorted(_evaluations(workdir)) == [2, 4, 6]
  c.eval.patience = 0  # without patience the same run goes on
  c.num_steps = 8
  assert not trainer_lib.train(c, workdir).stopped_early
  assert sorted(_evaluations(workdir)) == [2, 4, 6, 8]


def test_patience_needs_a_metric():
  c = _config()
  c.eval.patience, c.eval.keep_best = 3, ""
  with pytest.raises(ConfigError, match="eval.patience stops on the best eval.keep_best"):
    config_lib.validate(c)
  c = _config()
  c.eval.patience = -1
  with pytest.raises(ConfigError, match="eval.patience must be an int >= 0"):
    config_lib.validate(c)
