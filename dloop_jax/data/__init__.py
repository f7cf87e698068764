"""Drafter training data: TFDS builders (no TensorFlow needed) and the Grain pipeline.

    sharegpt          ShareGPT conversations, train / held-out split by id hash
    target_responses  the target's regenerated answers + its tapped hidden states
    shard_writer      streams a split into array_record shards (no TFDS shuffler)
    pipeline          Grain: shuffle -> pad / pack -> batch -> per-process shard

Build both from the command line with `python -m train.data --config
configs/data_<name>.py` (see docs/data.md).
"""

from dloop_jax.data.pipeline import (BATCH_KEYS, build_target_responses, check_dataset_matches,
                                     dataset_metadata, make_dataset, make_train_iterator,
                                     resolve_dataset_dir)
from dloop_jax.data.sharegpt import Sharegpt, ShareGPTConfig, build_sharegpt, heldout_prompts
from dloop_jax.data.target_responses import (BuildResult, TargetResponses, TargetResponsesConfig,
                                             make_config)
from dloop_jax.data.tfds_utils import default_data_dir

__all__ = [
    "BATCH_KEYS", "BuildResult", "ShareGPTConfig", "Sharegpt", "TargetResponses",
    "TargetResponsesConfig", "build_sharegpt", "build_target_responses", "check_dataset_matches",
    "dataset_metadata", "default_data_dir", "heldout_prompts", "make_config", "make_dataset",
    "make_train_iterator", "resolve_dataset_dir",
]
