"""The benchmark's llama.cpp peer (`infer.bench.llama_cpp_peer`).

llama.cpp comes with an optional extra (`pip install -e '.[llama-cpp]'`, built
from source), not with the project's install: without it the benchmark says so
in one line and reports the other rows, which the first tests check (absence
simulated). The real run on the default GGUF runs only where the extra is
installed; elsewhere it is skipped because the optional engine is absent, not
because a feature of the project is missing.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import infer
from dloop_jax.decoding import DecodingConfig
from dloop_jax.models import registry
from infer.bench import __main__ as bench_main
from infer.bench import llama_cpp_peer
from infer.bench import methods as methods_lib


class _Tokenizer:
  """Prompt text -> a few ids of the tiny target's vocabulary."""

  stop_token_ids = (2,)
  pad_token_id = 0

  def apply_chat_template(self, messages, *, add_generation_prompt):
    del add_generation_prompt
    return [1] + [3 + ord(c) % 60 for c in messages[-1]["content"][:6]]


class _HFModel:
  """Stands in for transformers' model: our ar's greedy tokens (the benchmark's own program)."""

  def __init__(self, target):
    self.ar = methods_lib.Ours(decoding=DecodingConfig(mode="ar"), target=target, max_new_tokens=4,
                               stop_tokens=[2])

  def generate(self, ids, **unused):
    del unused
    new = self.ar.run(ids[0].tolist()).tokens
    return torch.cat([ids, torch.tensor([new])], dim=1)


@pytest.fixture
def tiny_bench(monkeypatch, tiny, tmp_path):
  """Runs `python -m infer.bench` in process on the tiny target, llama-cpp-python absent:
  (argv -> exit code, output dir)."""
  monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
  monkeypatch.setattr(infer, "enable_compilation_cache", lambda: None)  # the tests' own cache
  loaded = registry.LoadedTarget(model=tiny, config=tiny.config, tokenizer=_Tokenizer(),
                                 source="DIR/tiny.gguf", name="tiny")
  monkeypatch.setattr(registry, "load_target", lambda source, **kw: loaded)
  monkeypatch.setattr(methods_lib, "load_hf_reference", lambda path, **kw: _HFModel(tiny))
  common = ["--target", "tiny.gguf", "--no-drafters", "--categories", "math",
            "--prompts-per-category", "1", "--max-new-tokens", "4", "--weights", "f32",
            "--fixed-widths", "", "--out", str(tmp_path)]
  return (lambda *argv: bench_main.main(common + list(argv))), tmp_path


def test_without_llama_cpp_one_line_says_how_to_install_and_the_other_rows_come_out(
    tiny_bench, capsys):
  run, out = tiny_bench
  assert run() == 0
  err = capsys.readouterr().err
  said = [line for line in err.splitlines() if "llama.cpp peer left out" in line]
  assert len(said) == 1, err
  assert "llama-cpp-python is not installed" in said[0]
  assert llama_cpp_peer.INSTALL in said[0]
  table = (out / "results.md").read_text()
  for method in ("ar", "hf", "hf_pld"):
    assert f"| overall | {method} |" in table
  assert "llama_cpp" not in table
  result = json.loads((out / "results.json").read_text())
  assert "llama_cpp" not in result["machine"]
  hf = [r for r in result["records"] if r["method"] == "hf"]
  assert hf and hf[0]["identical_to_ar"]


def test_llama_cpp_named_without_the_extra_is_an_error_that_says_how_to_install(
    tiny_bench, capsys):
  run, _ = tiny_bench
  assert run("--peers", "llama_cpp") == 2
  assert llama_cpp_peer.INSTALL in capsys.readouterr().err


def test_unknown_peer_fails_before_the_target_loads():
  assert bench_main.main(["--peers", "hf,vllm"]) == 2


def test_llama_cpp_greedy_run_on_the_default_gguf():
  """A few greedy tokens of llama.cpp on a chat prompt, the whole prompt evaluated on each run
  (the same tokens after another prompt was run)."""
  pytest.importorskip("llama_cpp", reason="the optional extra llama-cpp is not installed")
  model = llama_cpp_peer.load(registry.registry_path(registry.DEFAULT_TARGET), threads=1,
                              context=128)
  peer = llama_cpp_peer.LlamaCppPeer(model=model, max_new_tokens=4,
                                     stop_tokens=[model.token_eos()])

  def ids(text):  # a ChatML prompt (the file's template), tokenized by llama.cpp
    chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return model.tokenize(chat.encode(), add_bos=False, special=True)

  first = peer.run(ids("What is 2 + 2?"))
  assert 1 <= len(first.tokens) <= 4 and first.seconds > 0
  other = peer.run(ids("Name a colour."))
  assert other.tokens != first.tokens
  assert peer.run(ids("What is 2 + 2?")).tokens == first.tokens


def test_the_agreement_line_counts_identical_outputs_and_says_where_the_others_differ():
  records = [dict(method="llama_cpp", identical_to_ar=True),
             dict(method="llama_cpp", identical_to_ar=False, first_difference=20, top2_gap=0.011),
             dict(method="llama_cpp", identical_to_ar=False, first_difference=0, top2_gap=0.08),
             dict(method="hf", identical_to_ar=False, first_difference=1, top2_gap=0.5)]
  line = bench_main._agreement(records, "llama_cpp")
  assert line.startswith("llama_cpp: 1/3 outputs identical to our ar's;")
  assert "0 (0.080), 20 (0.011)" in line


def test_llama_cpp_teacher_forced_logits_predict_its_greedy_answer():
  """`infer.bench.quality.LlamaCpp`: row i of the logits is the distribution of token i + 1,
  whose argmax over the answer is llama.cpp's own greedy answer (no off-by-one against ours)."""
  pytest.importorskip("llama_cpp", reason="the optional extra llama-cpp is not installed")
  from infer.bench import quality  # pylint: disable=g-import-not-at-top
  target = registry.load_target(registry.DEFAULT_TARGET, dtype="float32")
  computation = quality._llama_cpp(target, threads=1, context=128)
  ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
  answer = computation.greedy(ids, max_new_tokens=6)
  logits = computation.logits(ids + answer)
  assert logits.shape == (len(ids) + 6, target.config.vocab_size)
  assert logits[len(ids) - 1:-1].argmax(-1).tolist() == answer
