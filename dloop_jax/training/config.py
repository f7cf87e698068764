"""The training config schema: `base_config()` and its validation.

Config files (`configs/*.py`) start from `base_config()`, which is locked: a
misspelt key in a config file or on the command line (`--config.optim.lr=...`)
fails at once with a "did you mean" suggestion instead of being silently added.
The sections `drafter`, `objective_cfg`, `data.options` and `target.overrides`
are free-form (their keys belong to the drafter, the objective, the data
pipeline and the tiny target, which validate them); config files replace them
wholesale.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

import ml_collections

from dloop_jax import mesh as mesh_lib
from dloop_jax import plain_values
from dloop_jax.errors import ConfigError
from dloop_jax.training import distributed as distributed_lib
from dloop_jax.training import sharding as sharding_lib

OBJECTIVES = ("eagle3_ttt", "block", "dspark", "domino", "loop_aware")
DTYPES = ("float32", "bfloat16")
DISTRIBUTED_MODES = distributed_lib.MODES
# Sections whose keys their own code checks (`eval.decoding`: DecodingConfig's fields).
FREE_FORM = ("drafter", "objective_cfg", "data.options", "target.overrides", "eval.decoding")
# Drafter kinds trained over the full vocabulary only: their objectives read
# whole distributions at target ids (labels, the target's probabilities). A
# trained one is restricted to a draft vocabulary afterwards, its weights kept
# (`dloop_jax.drafters.with_draft_vocab`).
FULL_VOCAB_KINDS = ("dspark", "domino")
# The distillation settings of the objectives (`objectives.SOFT_DEFAULTS`) and
# feature noise, at values that keep hard cross-entropy. Config files list them
# (`objective_settings`) so that the command line can set them
# (--config.objective_cfg.kl_weight=1).
DISTILLATION_DEFAULTS = dict(hard_weight=1.0, kl_weight=0.0, tv_weight=0.0,
                             feature_regression_weight=0.0, feature_noise=0.0)


def objective_settings(*, distillation: bool = True, **settings: Any) -> ml_collections.ConfigDict:
  """An `objective_cfg`: `settings` plus `DISTILLATION_DEFAULTS` (only feature_noise for
  objectives without distillation keys: dspark)."""
  base = (dict(DISTILLATION_DEFAULTS) if distillation
          else {"feature_noise": DISTILLATION_DEFAULTS["feature_noise"]})
  return ml_collections.ConfigDict(dict(base, **settings))


# eval.keep_best for the held-out teacher-forced tau (`heldout`).
HELDOUT_BEST = "heldout_tau"


def check_draft_vocab(kind: str, draft_vocab_size: Any) -> None:
  """Raises ConfigError for a draft vocabulary on a kind trained over the full one."""
  if kind in FULL_VOCAB_KINDS and draft_vocab_size:
    raise ConfigError(
        f"A {kind} drafter trains over the full vocabulary: set drafter.draft_vocab_size=0"
        f" (got {draft_vocab_size}), then restrict the trained drafter with python -m"
        " train.export --drafter WORKDIR --out DIR --draft-vocab-size N --token-counts DATASET"
        " (its weights are kept).")


def base_config() -> ml_collections.ConfigDict:
  """Defaults of every training option (locked)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_steps = 1000
  c.log_every_steps = 10
  # What is trained.
  c.target = ml_collections.ConfigDict(dict(
      # "tiny": a random tiny target (tests, tiny configs); otherwise anything
      # `dloop_jax.models.load_target` takes: a registry name
      # ("smollm2-135m-instruct"), a .gguf file or a Hugging Face directory.
      model="tiny",
      dtype="float32",
      seed=1,  # tiny only
      init_std=0.3,  # tiny only
      overrides=ml_collections.ConfigDict(),  # tiny only: TransformerConfig fields
  ))
  c.drafter = ml_collections.ConfigDict(dict(kind="eagle3"))
  # The dtype the drafter's forward and backward passes compute in. Weights,
  # gradients and the optimizer state stay in the drafter's own dtype (that of
  # target.dtype): "bfloat16" over float32 weights is mixed-precision training,
  # with the logits and the loss still in float32.
  c.compute_dtype = "float32"
  c.objective = "eagle3_ttt"
  c.objective_cfg = ml_collections.ConfigDict()
  # Where the data comes from. "tiny_random": the tiny target answers random
  # prompts (built into the workdir on first start); "path": a dataset built
  # with `python -m train.data`.
  c.data = ml_collections.ConfigDict(dict(
      source="tiny_random",
      path="",
      batch_size=8,  # global, over all processes
      seq_len=64,
      num_examples=256,  # tiny_random only
      max_examples=0,  # train on the first N examples of the split (0 = all)
      # The last N examples of the training split, never trained on: the
      # held-out teacher-forced metric (`eval.heldout_every_steps`).
      heldout_examples=0,
      # Online training: batches carry token ids only and the frozen target
      # runs inside the train step (its taps, its distribution).
      online=False,
      # The online target's forward: "auto" = bfloat16 on accelerators,
      # target.dtype on CPUs.
      online_dtype="auto",
      # Online soft targets: 0 = the target's full distribution; k = its k
      # likeliest tokens (as datasets built with target_topk = k hold).
      online_topk=0,
      shuffle_seed=0,
      worker_count=0,
      options=ml_collections.ConfigDict(),
  ))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-4,
      warmup_steps=50,
      end_lr_ratio=0.1,  # cosine decays to learning_rate * end_lr_ratio
      weight_decay=0.0,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      grad_clip_norm=0.5,
  ))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  c.sharding = ml_collections.ConfigDict(dict(
      rules=[list(r) for r in mesh_lib.DEFAULT_RULES],
      min_shard_size=sharding_lib.DEFAULT_MIN_SHARD_SIZE,
  ))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every_steps=200,
      keep=3,
      async_save=True,
  ))
  # A previous run to start from (its workdir, or a drafter export):
  # loop-aware fine-tuning starts from a normally trained drafter.
  c.init_from = ""
  c.export = ml_collections.ConfigDict(dict(enabled=True, path=""))  # "" = <workdir>/export
  # Acceptance length measured by the engine during training (`engine_eval`):
  # greedy `generate()` on held-out prompts, every draft verified.
  c.eval = ml_collections.ConfigDict(dict(
      every_steps=0,  # 0 = never; else every N steps and at the last step
      # "bench": the benchmark's prompts (math, code, chat; the target's chat
      # template); "random": random token ids (targets without a tokenizer);
      # else a JSONL file with a "prompt" field per line.
      prompts="bench",
      num_prompts=6,  # "bench": per category
      max_prompt_tokens=512,
      max_new_tokens=64,
      modes=("sd", "dloop"),
      # Fields of DecodingConfig (gate, max_stages, schedule, lookup, ...) that
      # override how the evaluation decodes (`engine_eval.EVAL_DECODING`:
      # every draft verified, free widths), e.g. c.eval.decoding.gate = -1.0.
      decoding=ml_collections.ConfigDict(),
      data_dir="",  # "bench": where the ShareGPT held-out prompts are ("" = default)
      keep_best="engine_tau_sd",  # export the best step by this metric to <workdir>/best
      # Early stopping: stop once this many evaluations in a row found no new
      # best keep_best (0 = train num_steps). A resumed run counts from the
      # best step's export, so a stopped run stays stopped.
      patience=0,
      # Teacher-forced acceptance on the data.heldout_examples (acc_1..K, the
      # tau they imply, standard errors over examples): every N steps and at
      # the last (0 = never). keep_best may then be "heldout_tau".
      heldout_every_steps=0,
  ))
  # "module:attribute" of a `TrainHooks` replacing how the target, drafter,
  # loss and data are built (custom drafters, tests).
  c.hooks = ""
  c.distributed = "auto"
  c.progress_bar = True
  c.tensorboard = True
  c.lock()
  c.eval.decoding.unlock()  # takes any field of DecodingConfig, checked by `validate`
  return c


def loop_aware_fine_tune(c: ml_collections.ConfigDict, *, num_steps: int,
                         learning_rate: float, warmup_steps: int,
                         max_stages: int = 3) -> ml_collections.ConfigDict:
  """The recipe's second step (docs/design.md §Loop-aware training) from the config of its first.

  Same drafter, target and data; the objective becomes `loop_aware` over up to
  `max_stages` stages of the first step's objective (its settings kept), with
  a shorter schedule. Run it with `--config.init_from=<first step's workdir>`.
  """
  base = c.objective
  if base == "loop_aware":
    raise ConfigError("loop_aware_fine_tune needs the config of a normally trained drafter;"
                      " this one already fine-tunes loop-aware.")
  settings = dict(plain_values.to_plain(c.objective_cfg), max_stages=max_stages,
                  base_objective=base)
  # Stated, so that a fine-tune aimed at a narrower stage (e.g. 2 x 2 for a 5-token
  # verification) can set it: --config.objective_cfg.block_size=2.
  if "block_size" in c.drafter:
    settings.setdefault("block_size", c.drafter.block_size)
  c.objective = "loop_aware"
  c.objective_cfg = ml_collections.ConfigDict(settings)
  c.num_steps = num_steps
  c.optim.learning_rate = learning_rate
  c.optim.warmup_steps = warmup_steps
  return c


def _walk(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
  for key, value in config.items():
    path = f"{prefix}{key}"
    yield path, value
    if isinstance(value, (ml_collections.ConfigDict, dict)) and path not in FREE_FORM:
      yield from _walk(value, path + ".")


def all_keys(config: Mapping[str, Any]) -> list[str]:
  """Dotted paths of every key (free-form sections not descended into)."""
  return [k for k, _ in _walk(config)]


def suggest(key: str, candidates: list[str]) -> str:
  close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
  if not close:
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
    hit = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    close = [by_leaf[hit[0]]] if hit else []
  return f"; did you mean {close[0]!r}?" if close else ""


def validate(config: Mapping[str, Any]) -> None:
  """Raises ConfigError for unknown keys (with a suggestion) and bad values."""
  known = all_keys(base_config())
  for key in all_keys(config):
    if key not in known and not any(key.startswith(f + ".") for f in FREE_FORM):
      raise ConfigError(f"Unknown config key {key!r}{suggest(key, known)}")
  missing = [k for k in known if k not in all_keys(config)]
  if missing:
    raise ConfigError(f"Config lacks keys {missing}; build configs from"
                      " dloop_jax.training.config.base_config().")
  c = config
  if c["objective"] not in OBJECTIVES:
    raise ConfigError(f"objective must be one of {OBJECTIVES}, got {c['objective']!r}.")
  if not c["target"]["model"]:
    raise ConfigError("target.model is empty; use 'tiny', a registry name, a .gguf file or a"
                      " Hugging Face directory.")
  if c["target"]["dtype"] not in DTYPES:
    raise ConfigError(f"target.dtype must be one of {DTYPES}, got {c['target']['dtype']!r}.")
  if c["compute_dtype"] not in DTYPES:
    raise ConfigError(f"compute_dtype must be one of {DTYPES}, got {c['compute_dtype']!r}.")
  if c["distributed"] not in DISTRIBUTED_MODES:
    raise ConfigError(f"distributed must be one of {DISTRIBUTED_MODES}, got"
                      f" {c['distributed']!r}.")
  for key in ("num_steps", "log_every_steps"):
    if not isinstance(c[key], int) or c[key] < 1:
      raise ConfigError(f"{key} must be an int >= 1, got {c[key]!r}.")
  if not isinstance(c["data"]["batch_size"], int) or c["data"]["batch_size"] < 1:
    raise ConfigError(f"data.batch_size must be an int >= 1, got {c['data']['batch_size']!r}.")
  if not isinstance(c["checkpoint"]["every_steps"], int) or c["checkpoint"]["every_steps"] < 1:
    raise ConfigError("checkpoint.every_steps must be an int >= 1, got"
                      f" {c['checkpoint']['every_steps']!r}.")
  e = c["eval"]
  if not isinstance(e["every_steps"], int) or e["every_steps"] < 0:
    raise ConfigError(f"eval.every_steps must be an int >= 0 (0 = no engine evaluation), got"
                      f" {e['every_steps']!r}.")
  d = c["data"]
  for key in ("heldout_examples", "online_topk"):
    if not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 0:
      raise ConfigError(f"data.{key} must be an int >= 0, got {d[key]!r}.")
  if not isinstance(d["online"], bool):
    raise ConfigError(f"data.online must be True or False, got {d['online']!r}.")
  if d["online_dtype"] not in ("auto",) + DTYPES:
    raise ConfigError(f"data.online_dtype must be 'auto' or one of {DTYPES}, got"
                      f" {d['online_dtype']!r}.")
  if d["online_topk"] and not d["online"]:
    raise ConfigError("data.online_topk sets what the online target computes; offline, the"
                      " dataset's target_topk (python -m train.data) does. Set data.online=True"
                      " or online_topk=0.")
  for key in ("heldout_every_steps",):
    if not isinstance(e[key], int) or isinstance(e[key], bool) or e[key] < 0:
      raise ConfigError(f"eval.{key} must be an int >= 0, got {e[key]!r}.")
  if e["heldout_every_steps"] and not d["heldout_examples"]:
    raise ConfigError("eval.heldout_every_steps measures the data.heldout_examples; set"
                      " data.heldout_examples (e.g. 64) or heldout_every_steps=0.")
  if e["keep_best"] == HELDOUT_BEST and not e["heldout_every_steps"]:
    raise ConfigError(f"eval.keep_best={HELDOUT_BEST!r} needs eval.heldout_every_steps > 0 (and"
                      " data.heldout_examples).")
  from dloop_jax.training import engine_eval  # pylint: disable=g-import-not-at-top
  engine_eval.decoding(e.get("decoding") or {})
  if e["every_steps"]:
    modes = tuple(e["modes"])
    if not modes or any(m not in ("sd", "dloop") for m in modes):
      raise ConfigError(f"eval.modes must be a non-empty subset of ('sd', 'dloop'), got {modes}.")
    best = e["keep_best"]
    measured = tuple(f"engine_tau_{m}" for m in modes) + (
        (HELDOUT_BEST,) if e["heldout_every_steps"] else ())
    if best and best not in measured:
      raise ConfigError(f"eval.keep_best={best!r} is not measured; use one of"
                        f" {list(measured)} or '' (keep none).")
    for key in ("num_prompts", "max_new_tokens", "max_prompt_tokens"):
      if not isinstance(e[key], int) or e[key] < 1:
        raise ConfigError(f"eval.{key} must be an int >= 1, got {e[key]!r}.")
    if not isinstance(e["patience"], int) or isinstance(e["patience"], bool) or e["patience"] < 0:
      raise ConfigError(f"eval.patience must be an int >= 0 (0 = no early stopping), got"
                        f" {e['patience']!r}.")
    if e["patience"] and not best:
      raise ConfigError("eval.patience stops on the best eval.keep_best; set keep_best (e.g."
                        " 'engine_tau_sd') or patience=0.")
  if "kind" not in c["drafter"]:
    raise ConfigError("drafter.kind is required (e.g. 'eagle3', 'block', 'dspark' or 'domino').")
  check_draft_vocab(c["drafter"]["kind"], c["drafter"].get("draft_vocab_size"))
  sharding_lib.normalize_rules(c["sharding"]["rules"])
