"""`python -m infer --profile gpu|tpu` on this CPU with the profiles' attention kernels run in
Pallas's interpret mode (`$DLOOP_INTERPRET_KERNELS=1`).

`test_lossless_matrix.py::test_the_accelerator_profiles_kernels_in_interpret_mode_keep_ar_outputs`
runs the kernels through `generate()`; here the command users type runs them (its `main`, in
this process) on a tiny GGUF target (head_dim 16, the GPU kernel's smallest), and its `--json` record says
which library kernels the decode program called (`attention_kernels`, recorded while the
program is traced: `models.attention_kernels.recording`). Without interpret mode the record
holds no Pallas kernel, and the first test fails.

The runs take free widths (`--fixed-width 0`, with `--allow-inexact` for the profiles' bf16
weights): at the profiles' fixed width of 16 every forward after prefill writes 16 tokens,
which keeps the XLA loop (`models.attention_kernels`: the kernels read a length per row); the
Pallas kernels serve one-token steps and read-only verifications, which only free widths run.
There `dloop` equals `ar` up to a 16-bit near-tie (docs/decoding.md, "What lossless
guarantees"): on this target and prompt the outputs are equal, and a difference is accepted only
at a near-tie of the target.

Three runs (mostly compiles), one per profile and mode that adds a kernel
path: `gpu` `ar` and `dloop` (flash decoding in the one-token steps and in the verifications,
which only read the cache), and `tpu` `ar` only: the TPU paged kernel serves one-token written
steps, which every decode step of `ar` is; a `tpu` `dloop` run would add no kernel path (its
verifications stay on the XLA loop: the paged kernel cannot be merged with a block of new
tokens). The `tpu` output is checked against the `gpu` profile's `ar` (the same bf16 target
through other kernels), as the library test does through `generate()` at two prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
from flax import nnx

import infer
import model_fixtures
from dloop_jax.decoding import GenerationOutput, RowStats
from dloop_jax.decoding.lossless import near_tie
from dloop_jax.drafters import build_drafter
from dloop_jax.drafters import io as drafter_io
from dloop_jax.models import attention_kernels
from dloop_jax.models import load_target
from lossless import assert_same_or_near_tie

PROMPT = "What is the capital of France?"
MAX_NEW = 6
# Each run's decode program: which library kernels it must call, which it must not.
EXPECTED = {
    # Prefill through jax.nn.dot_product_attention's XLA implementation (cuDNN has no
    # interpreter), flash decoding for the short forwards.
    "gpu": ({"dot_product", "pallas_gpu_interpret"}, {"cudnn", "pallas_gpu"}),
    "tpu": ({"pallas_tpu_interpret"}, {"pallas_tpu"}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str]:
  """(a tiny GGUF target whose text prompts encode per character, a block drafter's export)."""
  folder = tmp_path_factory.mktemp("interpret")
  model = model_fixtures.tiny_hf_model("llama_tied")  # 4 heads of 16 over 64, 2 kv heads
  gguf = model_fixtures.write_gguf(model, str(folder / "tiny.gguf"),
                                   tokens=model_fixtures.char_tokens(model.config.vocab_size))
  target = load_target(gguf, dtype="float32").model
  assert target.config.head_dim == 16
  drafter = build_drafter({"kind": "block", "block_size": 2, "num_layers": 1}, target=target,
                          rngs=nnx.Rngs(7))
  return gguf, drafter_io.export_drafter(drafter, folder / "drafter", target_name="tiny")


def _infer(gguf: str, *args: str) -> dict:
  """The `--json` record of one `python -m infer` run with the kernels in interpret mode.

  Run in this process (`infer.__main__.main`, the command's whole code path but the
  interpreter's start): the three runs share the imports and the test run's programs.
  """
  from infer import __main__ as infer_main  # pylint: disable=g-import-not-at-top
  out = io.StringIO()
  with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
    patch.setenv("DLOOP_INTERPRET_KERNELS", "1")
    patch.setattr(infer, "enable_compilation_cache", lambda: None)  # the suite's own cache
    code = infer_main.main(["--target", gguf, "--raw", "--prompt", PROMPT, "--max-new-tokens",
                            str(MAX_NEW), "--fixed-width", "0", "--allow-inexact", "--json",
                            *args])
  assert code == 0, out.getvalue()[-2000:]
  return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(files) -> dict[tuple[str, str], dict]:
  """(profile, mode) -> the run's record."""
  gguf, drafter = files
  return {
      ("gpu", "ar"): _infer(gguf, "--profile", "gpu", "--mode", "ar"),
      # Every draft verified, at widths 3 and 5: verifications that only read the cache.
      # Without the prompt lookup: a smaller program.
      ("gpu", "dloop"): _infer(gguf, "--profile", "gpu", "--mode", "dloop", "--drafter",
                               drafter, "--schedule", "off", "--max-stages", "2", "--lookup",
                               "off"),
      ("tpu", "ar"): _infer(gguf, "--profile", "tpu", "--mode", "ar"),
  }


def test_the_profiles_pallas_kernels_run_in_interpret_mode(runs):
  """Each run's program calls its profile's Pallas kernel in interpret mode, never compiled."""
  for (profile, mode), rec in runs.items():
    called = set(rec["attention_kernels"])
    wanted, compiled = EXPECTED[profile]
    assert wanted <= called and not called & compiled, (profile, mode, called)
    assert rec["mode"] == mode and rec["dtype"] == "bfloat16" and rec["weights"] == "bf16"
    assert rec["fixed_width"] is None and rec["new_tokens"] == len(rec["output_ids"]) > 0


def test_dloop_keeps_ar_outputs_under_the_kernels(runs, files):
  """`--mode dloop` (drafts verified) and the `tpu` profile give `gpu` `--mode ar`'s tokens."""
  ar, dloop, tpu = runs["gpu", "ar"], runs["gpu", "dloop"], runs["tpu", "ar"]
  assert ar["prompt_ids"] == dloop["prompt_ids"] == tpu["prompt_ids"]
  assert len(ar["prompt_ids"]) == len(PROMPT)  # one token per character
  assert len(ar["output_ids"]) == MAX_NEW
  assert dloop["verified"] > 0
  if dloop["output_ids"] != ar["output_ids"] or tpu["output_ids"] != ar["output_ids"]:
    # Free widths with 16-bit arithmetic: a difference only at a near-tie.
    with attention_kernels.interpret():
      target = load_target(files[0], profile="gpu").model
      for got in (dloop, tpu):
        assert_same_or_near_tie(target, ar["prompt_ids"], ar["output_ids"], got["output_ids"],
                                tol=near_tie(target))


@pytest.mark.parametrize("kernels,bracket", [
    (("dot_product", "pallas_gpu_interpret"),
     "[ar, bf16 weights, attention dot_product + pallas_gpu_interpret]"),
    ((), "[ar, bf16 weights]"),
])
def test_the_summary_line_names_the_kernels(capsys, kernels, bracket):
  """Without `--json` the summary line's bracket names the kernels (none: nothing)."""
  from infer.__main__ import _report  # pylint: disable=g-import-not-at-top
  out = GenerationOutput(tokens=[[5, 6]], rows=[RowStats(new_tokens=2, rounds=1,
                                                         committed_in_rounds=1)],
                         seconds=1.0, compile_seconds=1.0, mode="ar",
                         attention_kernels=kernels)
  tok = argparse.Namespace(decode=lambda ids, skip_special_tokens: "answer")
  target = argparse.Namespace(int8=False, weight_dtype="bfloat16", dtype="bfloat16")
  _report(argparse.Namespace(json=False), text=PROMPT, ids=[1], out=out, index=0, mode="ar",
          drafter=None, tok=tok, target=target, looks_up=False)
  printed = capsys.readouterr()
  assert printed.out == "answer\n" and printed.err.startswith(bracket + " 2 tokens in"), printed
