"""What a round commits: a verification's outcome as a chain, and the commit counts.

Chain rounds (`chain_round`) and tree rounds (`tree_round`) differ in what they
draft and how they verify; both end with a `Verified` (the accepted tokens
and what the target read along them, compacted to a chain), which the loop
commits (`decode_loop.DecodeLoop`):

    counts   tokens each row commits: the k accepted drafts and the bonus,
             cut at a stop token or at max_new_tokens (`commit_counts`)
    caches   the target cache's length becomes n + counts; the drafter reads
             the committed tokens now if some row accepted a draft, else the
             next drafting round reads them (`deferred`)
    stats    per-row counters of the round
    state    pending token, output buffer, done flags, drafting back-off
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.models import kv_cache as kv_lib


def commit_counts(*, new_tokens: jax.Array, num_valid: jax.Array, num_new: jax.Array,
                  max_new_tokens: jax.Array, stop: jax.Array) -> tuple[jax.Array, jax.Array]:
  """How many of `new_tokens` each row commits, and whether it finishes.

  A stop token is committed and ends the row; so does reaching max_new_tokens
  (possibly in the middle of an accepted block).

  Args:
    new_tokens: [B, W] candidate tokens in order.
    num_valid: [B] how many of them are valid.
    num_new: [B] tokens the row generated so far.
    max_new_tokens: the row limit (a traced scalar).
    stop: [K] stop token ids, padded with -1 (matches no token).

  Returns:
    counts [B], finished [B].
  """
  w = new_tokens.shape[1]
  t = jnp.arange(w)[None, :]
  valid = t < num_valid[:, None]
  hit = valid & jnp.isin(new_tokens, stop)
  first_stop = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), w)
  counts = jnp.minimum(num_valid, first_stop + 1)
  counts = jnp.minimum(counts, max_new_tokens - num_new)
  counts = jnp.maximum(counts, 0)
  finished = (num_valid > 0) & ((first_stop < counts) | (num_new + counts >= max_new_tokens))
  return counts, finished


@struct.dataclass
class Verified:
  """One verification forward and its acceptance, as a chain (per row).

  Attributes:
    cache: the target cache with the pending token's and the accepted drafts'
      keys / values written at slots n, n + 1, ... (lengths still to be set).
    num_accepted: [B] drafts accepted, k.
    new_tokens: [B, W] d_1..d_k, then the bonus token; padding after.
    tokens: [B, W] what the target read along them: pending token, d_1.., pad.
    taps: [B, W, n_taps, D] target taps at those positions.
    width: scalar, the width of the forward that ran.
  """

  cache: kv_lib.KVCache
  num_accepted: jax.Array
  new_tokens: jax.Array
  tokens: jax.Array
  taps: jax.Array
  width: jax.Array
