"""Builds the drafter training data: ShareGPT, then the target's regenerated responses.

    python -m train.data --config configs/data_smollm2.py [--data_dir DIR] \
        [--config.target_responses.num_prompts=256 ...] [--only target_responses]

`--data_dir` defaults to the config's `data_dir`, else $DLOOP_DATA_DIR, else
~/.cache/dloop_jax/datasets (under $XDG_CACHE_HOME when set). Rerunning an
interrupted command resumes: finished chunks of regenerated responses are
reused. The last lines printed name the dataset directory to train on:

    python -m train --config configs/smollm2_eagle3.py --workdir runs/x \
        --config.data.path=<that directory>

See docs/data.md.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Data config file (configs/data_*.py), optionally `path:recipe`.",
    lock_config=True)
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "TFDS data directory (default: config.data_dir, else the user cache).")
_ONLY = flags.DEFINE_list(
    "only", None, "Build only these datasets (sharegpt, target_responses).")
_SNAPSHOT = flags.DEFINE_bool(
    "snapshot", False,
    "target_responses: write a dataset of the chunks finished so far (by a running or killed"
    " build of the same config) under the config name + '_snapshot', generating nothing; the"
    " full build stays resumable.")
_ANSWERS_ONLY = flags.DEFINE_bool(
    "answers_only", False,
    "target_responses: answer the prompts into the config's responses_dir (token ids only,"
    " resumable) and write no dataset; a later build computes the features from them.")
flags.mark_flags_as_required(["config"])

DATASETS = ("sharegpt", "target_responses")


def _disk_bytes(dataset_dir: str) -> int:
  return sum(os.path.getsize(p) for p in glob.glob(os.path.join(dataset_dir, "*.array_record*")))


def build_from_config(config: Any, *, data_dir: str | None = None,
                      only: Sequence[str] | None = None, progress: bool = True,
                      snapshot: bool = False, answers_only: bool = False) -> dict[str, Any]:
  """Builds the datasets a data config names; returns a summary per dataset.

  Args:
    config: a data config (see configs/data_*.py).
    data_dir: TFDS data directory (default: config.data_dir, else the user cache).
    only: subset of `config.datasets` to build.
    progress: progress lines on stderr.
    snapshot: target_responses from the chunks finished so far (see --snapshot).
    answers_only: target_responses: answer the prompts into `config.responses_dir`
      only (see --answers_only).

  Returns:
    `{"data_dir": ..., "<dataset>": {"dataset_dir": ..., ...}}`.
  """
  # Local imports: absl flag parsing stays fast and `--help` works without them.
  from dloop_jax.data import sharegpt as sharegpt_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import target_responses as tr_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import target_responses_config  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import tfds_utils  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from dloop_jax.plain_values import to_plain  # pylint: disable=g-import-not-at-top

  data_dir = os.path.expanduser(data_dir or config.data_dir or tfds_utils.default_data_dir())
  wanted = list(only) if only else list(config.datasets)
  unknown = sorted(set(wanted) - set(DATASETS))
  if unknown:
    raise ConfigError(f"Unknown datasets {unknown}; choose from {list(DATASETS)}.")
  summary: dict[str, Any] = {"data_dir": data_dir}
  sg_options = to_plain(config.sharegpt)
  if "sharegpt" in wanted:
    builder = sharegpt_lib.build_sharegpt(data_dir=data_dir, **sg_options)
    summary["sharegpt"] = {
        "dataset_dir": os.fspath(builder.data_dir),
        "splits": {k: v.num_examples for k, v in builder.info.splits.items()},
        "dropped": dict(builder.info.metadata.get("dropped", {})),
    }
  if "target_responses" in wanted:
    keep = bool(config.keep_work_dir)
    tr_config = target_responses_config.config_from_data_config(config)
    work_dir = None
    if snapshot:
      # The snapshot reads the full build's chunks, and never deletes them.
      work_dir = tr_lib.default_work_dir(data_dir, tr_config)
      tr_config, keep = target_responses_config.snapshot_config(tr_config), True
    responses_dir = os.path.expanduser(config.get("responses_dir", "") or "") or None
    builder = tr_lib.TargetResponses(data_dir=data_dir, config=tr_config,
                                     file_format=tfds_utils.FILE_FORMAT, progress=progress,
                                     work_dir=work_dir, finished_chunks_only=snapshot,
                                     responses_dir=responses_dir)
    if answers_only:
      summary["target_responses"] = {"config": tr_config.name, **builder.answer_prompts()}
      return summary
    builder.download_and_prepare(download_config=tfds_utils.no_network_download_config())
    if not keep and os.path.isdir(builder.work_dir):
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(builder.work_dir, ignore_errors=True)
    dataset_dir = os.fspath(builder.data_dir)
    meta = tfds_utils.read_metadata(dataset_dir)
    totals = meta.get("totals", {})
    size = _disk_bytes(dataset_dir)
    tokens = int(totals.get("tokens", 0))
    summary["target_responses"] = {
        "dataset_dir": dataset_dir,
        "config": tr_config.name,
        "examples": int(totals.get("examples", 0)),
        "tokens": tokens,
        "response_tokens": int(totals.get("response_tokens", 0)),
        "new_tokens": int(totals.get("new_tokens", 0)),
        "generation_seconds": round(float(totals.get("generation_seconds", 0.0)), 2),
        "compile_seconds": round(float(totals.get("compile_seconds", 0.0)), 2),
        "new_tokens_per_second": round(float(totals.get("new_tokens_per_second", 0.0)), 2),
        "disk_bytes": size,
        "disk_bytes_per_1000_tokens": round(1000 * size / tokens) if tokens else None,
        "chunks_generated": builder.chunks_generated,
        "chunks_reused": builder.chunks_reused,
        "chunks_from_stored_answers": builder.chunks_from_store,
        "features_seconds": round(float(totals.get("features_seconds", 0.0)), 2),
        "taps": meta.get("taps"),
        "target_name": meta.get("target_name"),
    }
    if "snapshot" in meta:
      summary["target_responses"]["snapshot"] = meta["snapshot"]
  return summary


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  try:
    summary = build_from_config(_CONFIG.value, data_dir=_DATA_DIR.value, only=_ONLY.value,
                                progress=bool(_CONFIG.value.progress),
                                snapshot=_SNAPSHOT.value, answers_only=_ANSWERS_ONLY.value)
  except DLoopError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(summary, indent=2))
  if "target_responses" in summary and "dataset_dir" in summary["target_responses"]:
    print(f"\nTrain on it with: --config.data.source=path"
          f" --config.data.path={summary['target_responses']['dataset_dir']}")


if __name__ == "__main__":
  app.run(main)
