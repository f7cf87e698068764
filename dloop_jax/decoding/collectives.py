"""Transfers of attention arrays between devices, read from a mesh program's HLO.

On a mesh (`models.sharding`) each device holds its rows' kv heads of the KV
cache and attends them under `jax.shard_map`, so attention needs nothing from
another device: its queries, keys and values come out of the head-split
`wqkv` product on the device that holds their cache slice. What still crosses
devices per layer is the all-reduce of the head-split output product (and of
the MLP's), on hidden-sized activations [B, T, D].

A placement that put a cache slice and its heads' queries on different
devices shows up in the partitioned program as an all-gather, all-to-all or
collective-permute of a per-head array: a cache slice, queries, keys, values
or their RoPE angles, every one an f32 / 16-bit array of 3 or more axes whose
last axis is the head dimension. This counts those in the optimized HLO
(`jax.jit(f).lower(...).compile().as_text()`, `engine.decode_program`).
"""

from __future__ import annotations

import re

from dloop_jax import hlo_text as hlo
from dloop_jax.decoding import loop_copies

_MOVES = re.compile(r"\b(all-gather|all-to-all|collective-permute)(?:-start)?\(")
_FLOAT_SHAPE = re.compile(r"\b(?:f32|bf16|f16)\[([\d,]*)\]")


def head_transfers(hlo_text: str, *, head_dim: int) -> list[str]:
  """The all-gather / all-to-all / collective-permute instructions of an optimized program
  whose result or an operand is a per-head array (3 or more axes, the last `head_dim`).

  Returns:
    Their instruction lines (empty: attention moves nothing between devices).
  """
  found = []
  for line in loop_copies.unfused_instructions(hlo_text):
    if not hlo.INSTRUCTION.match(line) or not _MOVES.search(line):
      continue
    dims = [d.split(",") for d in _FLOAT_SHAPE.findall(line)]
    if any(len(d) >= 3 and d[-1] == str(head_dim) for d in dims):
      found.append(line.strip())
  return found
