"""dloop_jax: DLoop, looped speculative decoding, in JAX.

    import dloop_jax as dl

    target = dl.load_target("smollm2-135m-instruct")        # this machine's profile
    drafter = dl.load_drafter("smollm2-135m-instruct-block", target=target)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    out = dl.generate(target, [ids], max_new_tokens=64, mode="dloop", drafter=drafter)
    print(target.tokenizer.decode(out.tokens[0]), out.rows[0].acceptance_length)

The names below load on first use, so importing a submodule (`dloop_jax.errors`,
`dloop_jax.models`) does not import the whole library.
"""

from __future__ import annotations

from dloop_jax import lazy_exports

_EXPORTS = {
    "load_target": "dloop_jax.models.registry",
    "LoadedTarget": "dloop_jax.models.registry",
    "load_drafter": "dloop_jax.drafters.io",
    "generate": "dloop_jax.decoding.engine",
    "DecodingConfig": "dloop_jax.decoding.config",
    "SamplingConfig": "dloop_jax.decoding.sampling",
    "GREEDY": "dloop_jax.decoding.sampling",
    "GenerationOutput": "dloop_jax.decoding.stats",
    "RowStats": "dloop_jax.decoding.stats",
    "Profile": "dloop_jax.profiles",
    "DLoopError": "dloop_jax.errors",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports.attach(__name__, _EXPORTS)
