"""Bad user input fails early with an error that names the bad value.

Through the public API (`generate`, `SamplingConfig`) and the command line
(`python -m infer`: a one-line `error: ...` message, exit status 2, no
traceback).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import model_fixtures
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.errors import ConfigError, DLoopError, PromptTooLongError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [[1, 2, 3]]


# ------------------------------------------------------------ context window
def test_prompt_longer_than_the_context(tiny):
  """A prompt past the context window: PromptTooLongError giving both sizes."""
  context = tiny.config.max_position_embeddings
  with pytest.raises(PromptTooLongError) as err:
    generate(tiny, [[1] * (context + 44)], max_new_tokens=4)
  message = str(err.value)
  assert f"Prompt of {context + 44} tokens" in message
  assert f"context window of {context} tokens" in message
  assert "shorten the prompt" in message
  assert isinstance(err.value, ValueError) and isinstance(err.value, DLoopError)


def test_prompt_plus_new_tokens_past_the_context(tiny):
  """The prompt fits but prompt + max_new_tokens does not; the longest row decides."""
  context = tiny.config.max_position_embeddings
  with pytest.raises(PromptTooLongError,
                     match=rf"Prompt of {context - 6} tokens plus max_new_tokens=10 exceeds"
                           rf" the context window of {context} tokens of tiny;"):
    generate(tiny, [[1, 2], [1] * (context - 6)], max_new_tokens=10)


def test_prompt_filling_the_context_exactly_is_accepted(tiny):
  """prompt + max_new_tokens == context window is allowed and generates every token."""
  context = tiny.config.max_position_embeddings
  out = generate(tiny, [[5] * (context - 6)], max_new_tokens=6)
  assert len(out.tokens[0]) == 6


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), r"temperature must be a finite number >= 0 .*got -1\.0"),
    (dict(temperature=-1e-9), r"temperature .*got -1e-09"),
    (dict(temperature=math.nan), r"temperature .*got nan"),
    (dict(temperature=math.inf), r"temperature .*got inf"),
    (dict(temperature="0.7"), r"temperature .*got '0\.7'"),
    (dict(temperature=True), r"temperature .*got True"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0\.0"),
    (dict(top_p=-0.5), r"top_p must be in \(0, 1\], got -0\.5"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1\.5"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_k=-1), r"top_k must be an int >= 0 \(0 = no limit\), got -1"),
    (dict(top_k=2.5), r"top_k must be an int >= 0 .*got 2\.5"),
    (dict(top_k=True), r"top_k must be an int >= 0 .*got True"),
])
def test_bad_sampling_values(kwargs, match):
  """Negative / non-finite temperature, top_p outside (0, 1], negative or non-int top_k."""
  with pytest.raises(ConfigError, match=match):
    SamplingConfig(**kwargs)


def test_sampling_edge_values_and_numpy_scalars_are_accepted():
  """Boundary values are valid; numpy scalars work and become plain Python numbers."""
  for kwargs in (dict(temperature=0), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=0),
                 dict(temperature=1e-6, top_k=1, top_p=0.5)):
    SamplingConfig(**kwargs)
  config = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
  assert config == SamplingConfig(temperature=0.5, top_k=3, top_p=0.9)
  assert (type(config.temperature), type(config.top_k), type(config.top_p)) == (float, int, float)
  assert not config.greedy and SamplingConfig(temperature=np.float32(0)).greedy


def test_sampling_must_be_a_sampling_config(tiny):
  """A dict instead of a SamplingConfig is refused, not silently misread."""
  with pytest.raises(ConfigError, match="sampling must be a SamplingConfig"):
    generate(tiny, PROMPT, max_new_tokens=4, sampling={"temperature": 0.7})


# --------------------------------------------------------- generate arguments
@pytest.mark.parametrize("value", [0, -3, 2.5, 8.0, "8", None, True])
def test_bad_max_new_tokens(tiny, value):
  """max_new_tokens must be an int >= 1 (not a float, string, None or bool)."""
  with pytest.raises(ConfigError, match=rf"max_new_tokens must be an int >= 1, got {value!r}"):
    generate(tiny, PROMPT, max_new_tokens=value)


def test_numpy_int_max_new_tokens(tiny):
  """A numpy integer is a valid max_new_tokens."""
  out = generate(tiny, PROMPT, max_new_tokens=np.int64(5))
  assert len(out.tokens[0]) == 5


@pytest.mark.parametrize("prompts,match", [
    ([], "Every prompt needs at least one token"),
    ([[1, 2], []], "Every prompt needs at least one token"),
    ([[1, 64]], r"Prompt token ids must be in \[0, 64\); got 1\.\.64"),
    ([[-1, 3]], r"Prompt token ids must be in \[0, 64\); got -1\.\.3"),
])
def test_bad_prompts(tiny, prompts, match):
  """Empty prompts and token ids outside the vocabulary are refused."""
  with pytest.raises(ConfigError, match=match):
    generate(tiny, prompts, max_new_tokens=4)


# ---------------------------------------------------------------- command line
def _infer(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "infer", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def _assert_clean_error(proc: subprocess.CompletedProcess, match: str) -> None:
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  assert proc.stdout == ""
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(("error: ", "python -m infer: error: ")), proc.stderr
  assert re.search(match, last), last


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
  model = model_fixtures.tiny_hf_model("llama_tied")
  return model_fixtures.write_gguf(model, str(tmp_path_factory.mktemp("cli") / "tiny.gguf"))


def test_cli_non_integer_argument():
  """argparse rejects a non-integer --max-new-tokens before anything is loaded."""
  _assert_clean_error(_infer("--max-new-tokens", "ten"),
                      r"argument --max-new-tokens: invalid int value: 'ten'")


@pytest.mark.parametrize("args,match", [
    (("--temperature", "-1"), r"temperature must be a finite number >= 0 .*got -1\.0"),
    (("--top-p", "1.5"), r"top_p must be in \(0, 1\], got 1\.5"),
    (("--top-k", "-2"), r"top_k must be an int >= 0 .*got -2"),
])
def test_cli_bad_sampling(args, match):
  """Bad sampling flags: one error line naming the value, exit status 2."""
  _assert_clean_error(_infer(*args), match)


def test_cli_zero_max_new_tokens(tiny_gguf):
  """--max-new-tokens 0 is refused with the generate() message."""
  _assert_clean_error(_infer("--target", tiny_gguf, "--mode", "ar", "--max-new-tokens", "0"),
                      r"max_new_tokens must be an int >= 1, got 0")


@pytest.mark.real_model
def test_cli_prompt_too_long():
  """Asking for more tokens than the default model's context: the sizes are printed (before
  the target loads: test_infer_defaults.py)."""
  _assert_clean_error(_infer("--mode", "ar", "--max-new-tokens", "100000", "--prompt", "Hi"),
                      r"--max-new-tokens 100000 leaves no room for a prompt in the context"
                      r" window of \d+ tokens")
