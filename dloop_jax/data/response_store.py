"""The target's answers alone (token ids), kept apart from the tapped features.

Answering the prompts is the slow part of a `target_responses` build (the
target decodes token by token); the tapped hidden states the drafters train on
take one forward pass over prompt + answer once the answers exist, and they
are large (3 taps x 576 values x 2 bytes = 3.4 kB a token on SmolLM2-135M,
about 1 GB per 1,000 answers), while the answers take ~2 bytes a token
compressed. A response store keeps only the answers, so it fits where the
features do not (the repository, a small volume), and a build on another
machine reads it instead of answering again, sparing the hours of decoding
that the answers took (docs/data.md).

Layout of a store, one directory per build setting (`store_name`):

    <root>/<store name>/plan.json          what was answered (settings, prompts)
    <root>/<store name>/chunk_00012.npz    a finished chunk of answers

Each chunk (compressed npz, written under a temporary name, then renamed)
holds, for prompts `index` in [k * chunk_size, (k + 1) * chunk_size):

    index, keys            [n] int64 / str    generation order, prompt key
    tokens                 [sum L] int32      prompt + answer of each example, flat
    lengths, prompt_lens   [n] int64
    stopped                [n] bool           the answer ended with a stop token
    seconds, compile_seconds, new_tokens      what answering the chunk cost

The store's name hashes every setting but the taps and `target_topk`: one set
of answers serves builds that tap other layers or store target distributions.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from dloop_jax.errors import ConfigError

ANSWER_KEYS = ("index", "keys", "tokens", "lengths", "prompt_lens", "stopped", "seconds",
               "compile_seconds", "new_tokens")


def save_npz_atomic(path: str, arrays: Mapping[str, np.ndarray], *,
                    compressed: bool = False) -> None:
  """Writes an npz under a temporary name, then renames: never a partial file."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    (np.savez_compressed if compressed else np.savez)(f, **arrays)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


# Settings of a build that do not change its answers.
NOT_ANSWER_SETTINGS = ("taps", "target_topk")


def claim_directory(directory: str, plan: Mapping[str, Any], *, refusal: str) -> None:
  """Makes `directory` the home of chunks of `plan` (its plan.json), or refuses.

  A directory that already holds another plan raises `ConfigError(refusal)`;
  temporary files a killed writer left are removed.
  """
  os.makedirs(directory, exist_ok=True)
  plan = json.loads(json.dumps(dict(plan)))  # as it reads back: lists, not tuples
  plan_path = os.path.join(directory, "plan.json")
  if os.path.exists(plan_path):
    with open(plan_path) as f:
      if json.load(f) != plan:
        raise ConfigError(refusal)
  else:
    with open(plan_path + ".tmp", "w") as f:
      json.dump(plan, f, indent=1, sort_keys=True)
      f.write("\n")
    os.replace(plan_path + ".tmp", plan_path)
  for name in os.listdir(directory):
    if ".tmp-" in name:
      os.remove(os.path.join(directory, name))  # left by a killed run


def answer_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
  """The settings that decide the answers: all of a build's but the taps and distributions."""
  return {k: v for k, v in spec.items() if k not in NOT_ANSWER_SETTINGS}


def store_name(*, target_slug: str, spec: Mapping[str, Any]) -> str:
  digest = hashlib.sha256(json.dumps(answer_spec(spec), sort_keys=True).encode()).hexdigest()
  return f"{target_slug}_answers_{digest[:10]}"


class ResponseStore:
  """The answers of one build setting under `root` (see the module docstring)."""

  def __init__(self, root: str, *, name: str, plan: Mapping[str, Any]):
    """Opens (or starts) the store `root/name` for `plan`.

    Args:
      root: the directory holding stores.
      name: `store_name(...)` of the build.
      plan: what is answered ({"config": answer_spec, "target_name", "prompts"
        hash}); a store holding answers of another plan is refused.

    Raises:
      ConfigError: the directory holds another plan's answers.
    """
    self.dir = os.path.join(os.fspath(root), name)
    claim_directory(self.dir, plan, refusal=(
        f"The response store {self.dir} holds answers of a different build (other prompts,"
        " target or settings). Delete it, or point responses_dir elsewhere."))

  def path(self, k: int) -> str:
    return os.path.join(self.dir, f"chunk_{k:05d}.npz")

  def load(self, k: int, *, expected_index: np.ndarray) -> dict[str, np.ndarray] | None:
    """Chunk k's answers, or None when missing, unreadable or of other prompts."""
    path = self.path(k)
    if not os.path.exists(path):
      return None
    try:
      with np.load(path, allow_pickle=False) as z:
        arrays = {key: z[key] for key in ANSWER_KEYS}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
      print(f"[response_store] ignoring unreadable chunk {path} ({type(e).__name__}: {e}).",
            file=sys.stderr)
      return None
    if not np.array_equal(arrays["index"], expected_index):
      return None
    return arrays

  def save(self, k: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Stores the answer fields of a chunk (features, if present, are left out)."""
    save_npz_atomic(self.path(k), {key: arrays[key] for key in ANSWER_KEYS}, compressed=True)

  def finished(self) -> list[int]:
    return sorted(int(n[len("chunk_"):-len(".npz")]) for n in os.listdir(self.dir)
                  if n.startswith("chunk_") and n.endswith(".npz"))
