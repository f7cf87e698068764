"""The public face: `import dloop_jax as dl` and what `load_target` returns going straight on."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dloop_jax as dl
import model_fixtures


def test_every_public_name_is_the_library_object_of_that_name():
  for name in dl.__all__:
    value = getattr(dl, name)
    # The object of that name in the library module that defines it (a constant: its
    # class's module), not a stand-in.
    assert value.__module__.startswith("dloop_jax."), (name, value.__module__)
    assert getattr(sys.modules[value.__module__], name) is value, name
  assert dl.GREEDY == dl.SamplingConfig() and dl.GREEDY.greedy
  with pytest.raises(dl.DLoopError, match="Unknown decoding option"):  # what the library raises
    dl.DecodingConfig().replace(gamma=3)
  assert set(dl.__all__) <= set(dir(dl))
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    getattr(dl, "nope")


def test_importing_a_submodule_does_not_import_the_library():
  # dloop_jax.errors without jax, flax or the engine; then the benchmark's prompt sets
  # without the training data stack (Grain, TFDS), whose names it still lists.
  code = ("import sys, dloop_jax.errors; "
          "print(any(m.startswith(('jax', 'flax', 'dloop_jax.decoding')) for m in sys.modules));"
          " import dloop_jax.data.bench_prompts; "
          "print(any(m.startswith(('grain', 'tensorflow_datasets', 'array_record'))"
          " for m in sys.modules)); import dloop_jax.data as d; print('make_dataset' in dir(d))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False", "False", "True"]


def test_generate_takes_what_load_target_returns(tmp_path):
  path = model_fixtures.save_hf(model_fixtures.tiny_hf_model("llama_tied"), str(tmp_path / "m"))
  target = dl.load_target(path, dtype="float32")
  config = dl.DecodingConfig(mode="ar")
  out = dl.generate(target, [[1, 2, 3]], max_new_tokens=4, config=config)
  assert out.tokens == dl.generate(target.model, [[1, 2, 3]], max_new_tokens=4).tokens
  assert isinstance(out, dl.GenerationOutput) and len(out.tokens[0]) == 4
  with pytest.raises(dl.DLoopError, match="unknown option"):
    dl.generate(target, [[1, 2, 3]], max_new_tokens=4, gamma=3)
