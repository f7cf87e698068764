"""Drafters: the interface the engine drives, and the drafters DLoop applies to.

    drafter = build_drafter({"kind": "eagle3"}, target=target, rngs=nnx.Rngs(0))
    out = generate(target, prompts, max_new_tokens=64, mode="dloop", drafter=drafter)
"""

from dloop_jax.decoding.drafter import Drafter, DraftStage, TreeStage
from dloop_jax.drafters.base import Frozen, VocabMap
from dloop_jax.drafters.block import BlockDrafter, BlockState
from dloop_jax.drafters.domino import DominoDrafter, DominoState
from dloop_jax.drafters.dspark import DSparkDrafter
from dloop_jax.drafters.eagle3 import Eagle3Drafter, Eagle3State
from dloop_jax.drafters.registry import (build_drafter, default_drafter_config, resolve_config,
                                         with_draft_vocab)
from dloop_jax.drafters.spec import KINDS, DrafterSpec
from dloop_jax.drafters.vocab import draft_vocab_from_counts, token_counts

__all__ = [
    "Drafter", "DraftStage", "Frozen", "TreeStage", "VocabMap", "BlockDrafter", "BlockState",
    "DSparkDrafter", "DominoDrafter", "DominoState", "Eagle3Drafter", "Eagle3State",
    "build_drafter", "default_drafter_config", "with_draft_vocab",
    "resolve_config", "KINDS", "DrafterSpec", "draft_vocab_from_counts", "token_counts",
]
