"""The KV cache takes one update per layer array per forward, whatever the batch.

Per-row writes (one dynamic-update-slice per row and layer, or a loop over
rows) made the program grow with the batch and serialised the writes; this
counts the cache updates in the HLO a forward hands to XLA so they do not
return. (A backend may still lower one scatter as it likes: XLA:CPU expands
it into a loop over its (row, kv head) windows.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

_CAPACITY = 16


def _step_hlo(model, batch: int, width: int) -> str:
  graph, state = nnx.split(model)

  def step(state, cache, tokens):
    m = nnx.merge(graph, state)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None]
    o = m(tokens, positions=positions, cache=cache)
    return o.cache, o.logits

  cache = model.init_cache(batch_size=batch, capacity=_CAPACITY)
  tokens = jnp.zeros((batch, width), jnp.int32)
  return jax.jit(step).lower(state, cache, tokens).compiler_ir("hlo").as_hlo_text()


def _cache_updates(hlo: str, shape: str) -> int:
  """Scatters / dynamic-update-slices (fused or not) whose result has the cache's `shape`."""
  count = 0
  for line in hlo.splitlines():
    if "scatter(" in line or "dynamic-update-slice(" in line:
      result = line.split("=", 1)[1].split("{")[0]
      count += shape in result
  return count


@pytest.mark.parametrize("batch", [1, 4, 24])
def test_one_cache_update_per_layer_array(tiny, batch):
  c = tiny.config
  hlo = _step_hlo(tiny, batch, width=3)
  shape = f"f32[{batch * c.num_kv_heads},{_CAPACITY},{c.head_dim}]"
  assert _cache_updates(hlo, shape) == 2 * c.num_layers  # keys and values of each layer
  assert "while(" not in hlo  # no loop over rows either

