"""The finished chunks of a `target_responses` build: read back, and turned into examples.

A build saves each chunk of answered prompts as one uncompressed .npz in its
work directory (`response_store.save_npz_atomic`); tokens and features are
stored flat, one row after another. A restarted build reads the chunks back
(an unreadable one, or one of other prompts, is generated again), and the
features stay memory-mapped until the dataset is written.
"""

from __future__ import annotations

import os
import sys
import zipfile
from typing import Any

import numpy as np

from dloop_jax.data.target_responses_config import NAME, TOPK_KEYS


def load_chunk(path: str, *, expected_index: np.ndarray) -> dict[str, np.ndarray] | None:
  """A finished chunk, or None if it is unreadable or belongs to other prompts.

  "features" (most of the bytes) is memory-mapped, not read: writing the
  dataset visits examples in TFDS's hashed order, across all chunks.
  """
  try:
    with np.load(path, allow_pickle=False) as z:
      arrays = {k: z[k] for k in z.files if k != "features"}
    arrays["features"] = npz_memmap(path, "features")
  except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
    print(f"[{NAME}] ignoring unreadable chunk {path} ({type(e).__name__}: {e});"
          " regenerating it.", file=sys.stderr)
    return None
  if not np.array_equal(arrays.get("index"), expected_index):
    return None
  return arrays


def load_chunk_if_exists(path: str, *, expected_index: np.ndarray
                         ) -> dict[str, np.ndarray] | None:
  """`load_chunk`, or None when no chunk was saved at `path`."""
  return load_chunk(path, expected_index=expected_index) if os.path.exists(path) else None


def npz_memmap(path: str, name: str) -> np.ndarray:
  """Array `name` of an uncompressed .npz (what `np.savez` writes), memory-mapped."""
  with zipfile.ZipFile(path) as z:
    info = z.getinfo(f"{name}.npy")
  if info.compress_type != zipfile.ZIP_STORED:
    with np.load(path, allow_pickle=False) as z:
      return z[name]
  with open(path, "rb") as f:
    f.seek(info.header_offset)
    local = f.read(30)  # the zip local file header; its name and extra field follow
    if local[:4] != b"PK\x03\x04":
      raise ValueError(f"bad zip local header for {name}")
    name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(
        local[28:30], "little")
    f.seek(info.header_offset + 30 + name_len + extra_len)
    version = np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read_header(f)
    offset = f.tell()
  if fortran:
    raise ValueError(f"{name} is stored in Fortran order")
  return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def chunk_example(arrays: dict[str, np.ndarray], offsets: np.ndarray, i: int) -> dict[str, Any]:
  """Example i of a chunk (tokens and features are stored flat; offsets = cumsum of lengths)."""
  a, b = int(offsets[i]), int(offsets[i + 1])
  prompt_len = int(arrays["prompt_lens"][i])
  mask = np.zeros((b - a,), np.int32)
  mask[prompt_len:] = 1
  return {
      "index": int(arrays["index"][i]),
      "prompt_key": str(arrays["keys"][i]),
      "tokens": arrays["tokens"][a:b].astype(np.int32),
      "loss_mask": mask,
      "prompt_len": prompt_len,
      "response_len": (b - a) - prompt_len,
      "stopped": bool(arrays["stopped"][i]),
      "features": np.asarray(arrays["features"][a:b]),
      **{key: np.asarray(arrays[key][a:b]) for key in TOPK_KEYS if key in arrays},
  }

