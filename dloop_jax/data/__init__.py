"""Drafter training data: TFDS builders (no TensorFlow needed) and the Grain pipeline.

    sharegpt          ShareGPT conversations, train / held-out split by id hash
    target_responses  the target's regenerated answers + its tapped hidden states
                      (its config, prompts, progress, chunk cache and taps forward
                      in target_responses_config, training_prompts, build_progress,
                      chunk_cache, taps_forward)
    shard_writer      streams a split into array_record shards (no TFDS shuffler)
    pipeline          Grain: shuffle -> pad / pack -> batch -> per-process shard

Build both from the command line with `python -m train.data --config
configs/data_<name>.py` (see docs/data.md).

The names below load on first use: the benchmark's prompt sets
(`dloop_jax.data.bench_prompts`) import neither Grain nor TFDS.
"""

from __future__ import annotations

from dloop_jax import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("BATCH_KEYS", "build_target_responses", "check_dataset_matches",
                     "dataset_metadata", "make_dataset", "make_train_iterator",
                     "resolve_dataset_dir"), "dloop_jax.data.pipeline"),
    **dict.fromkeys(("Sharegpt", "ShareGPTConfig", "build_sharegpt", "heldout_prompts"),
                    "dloop_jax.data.sharegpt"),
    **dict.fromkeys(("BuildResult", "TargetResponses"), "dloop_jax.data.target_responses"),
    **dict.fromkeys(("TargetResponsesConfig", "make_config"),
                    "dloop_jax.data.target_responses_config"),
    "default_data_dir": "dloop_jax.data.tfds_utils",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports.attach(__name__, _EXPORTS)
