"""Public drafter formats against their authors' own code, in both directions.

The oracle is the upstream packages themselves (installed by scripts/setup.sh,
never copied here): SpecForge's `LlamaForCausalLMEagle3`, `DFlashDraftModel`
and `DominoDraftModel`, and z-lab's `dflash.model.DFlashDraftModel`. Each test
builds a drafter with the upstream class on a tiny transformers target
(Llama-3.1 style: rope_scaling llama3 and theta 500000; Qwen3 style), saves it
with the upstream save path, loads it with ours and compares first-stage
logits (f32, <= 1e-4) and greedy drafts; then exports ours and loads it with
the upstream loader, same comparison. The upstream forward is driven with the
upstream modules (rotary embedding, layers, heads); only the loop around them
(re-running the causal prefix per draft, the block positions) is written here,
as their generation loops do it.

DeepSpec (DSpark's Qwen3DSparkModel) has no package on the index: its layout is
checked against the hand-written reference in tests/test_hf_formats.py.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

# SpecForge compiles its rotary embedding's forward with torch.compile; eager is the same
# computation and needs no compiler on a CPU machine.
torch._dynamo.config.disable = True  # pylint: disable=protected-access

# The upstream packages: imported unconditionally, so the suite fails (never skips) when
# scripts/setup.sh did not install them.
import dflash.model as zlab_dflash  # noqa: E402
from specforge.export.checkpoint_io import apply_legacy_rope_scaling  # noqa: E402
from specforge.modeling.auto import AutoDraftModel  # noqa: E402
from specforge.modeling.draft.dflash import DFlashDraftModel as SFDFlash  # noqa: E402
from specforge.modeling.draft.domino import DominoDraftModel as SFDomino  # noqa: E402
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config,  # noqa: E402
                          Qwen3ForCausalLM)

import drafter_programs  # noqa: E402
from dloop_jax.decoding import SamplingConfig, generate  # noqa: E402
from dloop_jax.drafters import build_drafter  # noqa: E402
from dloop_jax.drafters import io as drafter_io  # noqa: E402
from dloop_jax.models.registry import load_target  # noqa: E402

torch.set_num_threads(1)  # see model_fixtures

V, D, L = 96, 64, 8
HEADS, KV, HD, FF = 4, 2, 16, 96
VD = 48  # EAGLE-3 draft vocabulary, smaller than the target's
N = 12  # prompt length
EPS = 1e-5
GREEDY = SamplingConfig()
LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)
TOL = dict(rtol=1e-4, atol=1e-4)


def _randomize(module: torch.nn.Module, seed: int, *, scale: float = 1.0) -> None:
  """Weights that make peaked, tie-free distributions: N(0, scale / sqrt(fan_in)), norms ~1."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim == 1:
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
      elif "embed" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
      else:
        p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


class Target:
  """A tiny transformers target and ours, read from the directory it was saved to."""

  def __init__(self, hf: torch.nn.Module, path: str):
    self.hf = hf.eval()
    self.path = path
    self.ours = load_target(path, dtype=jnp.float32, weights="f32").model

  def taps(self, prompt: list[int], layers) -> np.ndarray:
    """transformers' hidden states after each layer of `layers` (HF index l + 1): [N, n, D]."""
    with torch.no_grad():
      out = self.hf(torch.as_tensor([prompt]), output_hidden_states=True)
    return np.stack([out.hidden_states[l + 1][0].numpy() for l in layers], axis=1)

  def greedy_next(self, prompt: list[int]) -> int:
    with torch.no_grad():
      return int(self.hf(torch.as_tensor([prompt])).logits[0, -1].argmax())


def _make_target(family: str, path: str) -> Target:
  common = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=L,
                num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                rms_norm_eps=EPS, max_position_embeddings=128, tie_word_embeddings=False)
  if family == "llama31":
    hf = LlamaForCausalLM(LlamaConfig(rope_theta=500000.0, rope_scaling=dict(LLAMA31_ROPE),
                                      **common))
  else:
    hf = Qwen3ForCausalLM(Qwen3Config(rope_theta=1000000.0, **common))
  _randomize(hf, seed=1, scale=1.5)
  hf.save_pretrained(path)
  return Target(hf, path)


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
  return _make_target("llama31", str(tmp_path_factory.mktemp("llama31")))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  return _make_target("qwen3", str(tmp_path_factory.mktemp("qwen3")))


def _prompt(seed: int) -> list[int]:
  return np.random.default_rng(seed).integers(0, V, N).tolist()


# ----------------------------------------------------------------- ours
CAPACITY = 32  # drafter cache slots of every comparison


def _commit(drafter, features, next_tokens):
  return drafter_programs.commit(drafter, features, next_tokens, CAPACITY)


# ------------------------------------------------------------- EAGLE-3
EAGLE3_TAPS = (1, L // 2 - 1, L - 4)  # the taps upstream captures: layers 1, L/2 - 1, L - 4


def _specforge_load(path: str, **kwargs):
  """SpecForge's loader. Its EAGLE-3 rotary tables are non-persistent buffers computed in
  __init__, which transformers >= 5 builds on the meta device and leaves uninitialised:
  they are computed again by SpecForge's own `_init_rope` (from the loaded config)."""
  model = AutoDraftModel.from_pretrained(path, **kwargs).eval()
  if isinstance(model, LlamaForCausalLMEagle3):
    model.midlayer.self_attn._init_rope()  # pylint: disable=protected-access
  return model


def _eagle3_upstream(model, features: np.ndarray, next_tokens: list[int], num_drafts: int):
  """SpecForge's EAGLE-3 modules over the committed pairs, then a greedy chain.

  Each chain step re-runs the causal prefix (pairs (fc(taps_t), x_{t+1}), then the
  drafter's own last output with its last draft), as a decoding loop with a KV cache
  computes it; drafts are mapped to target ids with d2t offsets.

  Returns:
    (logits of the committed pairs [N, Vd], target ids of the chain).
  """
  with torch.no_grad():
    hidden = model.project_hidden_states(torch.as_tensor(features).reshape(1, len(features), -1))
    tokens = torch.as_tensor([next_tokens])
    drafts, logits0 = [], None
    for _ in range(num_drafts):
      n = tokens.shape[1]
      out = model.backbone(model.embed_input_ids(tokens), hidden, None, None,
                           torch.arange(n)[None], use_cache=False)
      logits = model.compute_logits(out)[0]
      logits0 = logits if logits0 is None else logits0
      draft = int(logits[-1].argmax())
      target_id = draft + int(model.d2t[draft])
      drafts.append(target_id)
      hidden = torch.cat([hidden, out[:, -1:]], dim=1)
      tokens = torch.cat([tokens, torch.as_tensor([[target_id]])], dim=1)
  return logits0.numpy(), drafts


def _eagle3_compare(target: Target, drafter, model, *, seed: int):
  prompt = _prompt(seed)
  features = target.taps(prompt, drafter.taps)
  next_tokens = prompt[1:] + [target.greedy_next(prompt)]
  want_logits, want = _eagle3_upstream(model, features, next_tokens, 3)
  logits, got, _ = drafter_programs.eagle3_program(
      drafter, jnp.asarray(features), jnp.asarray(next_tokens, jnp.int32), 3, CAPACITY)
  np.testing.assert_allclose(np.asarray(logits), want_logits, **TOL)
  assert np.asarray(got).tolist() == want


def _draft_vocab(seed: int) -> np.ndarray:
  return np.sort(np.random.default_rng(seed).choice(V, VD, replace=False))


def _specforge_eagle3(target: Target, path: str, *, seed: int, **config) -> str:
  """An EAGLE-3 drafter built and saved by SpecForge; config.json as upstream writes it."""
  cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=1,
                    num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                    rms_norm_eps=EPS, max_position_embeddings=128, draft_vocab_size=VD,
                    architectures=["LlamaForCausalLMEagle3"], tie_word_embeddings=False, **config)
  model = LlamaForCausalLMEagle3(cfg)
  _randomize(model, seed)
  used = _draft_vocab(seed)
  with torch.no_grad():
    model.embed_tokens.weight.copy_(target.hf.model.embed_tokens.weight)
    model.d2t.copy_(torch.as_tensor(used - np.arange(VD)))
    model.t2d.zero_()
    model.t2d[torch.as_tensor(used)] = True
  model.save_pretrained(path)
  apply_legacy_rope_scaling(path)
  return path


@pytest.mark.parametrize("norm_output", [True, False])
def test_specforge_eagle3_loads_into_ours(llama31, tmp_path, norm_output):
  """SpecForge's drafter (theta 10000, no scaling) next to a Llama-3.1 target (theta 500000,
  llama3 scaling): ours rotates with the drafter's RoPE, not the target's."""
  extra = {} if norm_output else {"norm_output": False}
  path = _specforge_eagle3(llama31, str(tmp_path / "sf"), seed=5, **extra)
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["rope_theta"] == 10000.0  # SpecForge's default, whatever the target's
  drafter = drafter_io.load_drafter(path, target=llama31.ours)
  assert (drafter.spec.rope_theta, drafter.spec.rope_scaling) == (10000.0, None)
  assert drafter.spec.norm_output is norm_output
  assert drafter.taps == EAGLE3_TAPS
  model = _specforge_load(path)
  _eagle3_compare(llama31, drafter, model, seed=11)


@pytest.mark.parametrize("rope", ["target", "own"])
def test_our_eagle3_export_loads_into_specforge(llama31, tmp_path, rope):
  """Ours, rotating as the target does (a drafter trained here) or with its own theta 10000,
  exported and read by SpecForge's loader."""
  config = {"kind": "eagle3", "draft_vocab_size": VD, "num_heads": HEADS, "num_kv_heads": KV,
            "head_dim": HD, "intermediate_size": FF, "taps": list(EAGLE3_TAPS)}
  if rope == "own":
    config["rope_theta"] = 10000.0
  drafter = build_drafter(config, target=llama31.ours, rngs=nnx.Rngs(7))
  drafter.set_draft_vocab(_draft_vocab(8), target=llama31.ours)
  drafter.wo[...] = drafter.wo[...] * 4.0  # a layer far from the identity
  path = drafter_io.export_drafter(drafter, tmp_path / "ours", format="hf")
  model = _specforge_load(path)
  with torch.no_grad():  # our export leaves the (frozen) embedding out: the target's
    model.embed_tokens.weight.copy_(llama31.hf.model.embed_tokens.weight)
  _eagle3_compare(llama31, drafter, model, seed=12)


def _llama31_reference_layout(target: Target, path: str) -> str:
  """An EAGLE-3 checkpoint written as the reference Llama-3.1 drafters are: config.json
  without rope_theta / rope_scaling, pytorch_model.bin with d2t / t2d and no embedding."""
  os.makedirs(path, exist_ok=True)
  model = LlamaForCausalLMEagle3(LlamaConfig(
      vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=1,
      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD, rms_norm_eps=EPS,
      draft_vocab_size=VD, tie_word_embeddings=False))
  _randomize(model, 21, scale=0.5)
  # A head close to the target's over the draft vocabulary: a drafter that agrees with its
  # target often, so decoding both accepts drafts and rejects some.
  used = _draft_vocab(21)
  state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
  state["lm_head.weight"] = target.hf.lm_head.weight.detach()[torch.as_tensor(used)].clone()
  state["d2t"] = torch.as_tensor(used - np.arange(VD), dtype=torch.int64)
  state["t2d"] = torch.zeros(V, dtype=torch.bool)
  state["t2d"][torch.as_tensor(used)] = True
  torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()},
             os.path.join(path, "pytorch_model.bin"))
  config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=D,
                intermediate_size=FF, num_attention_heads=HEADS, num_key_value_heads=KV,
                head_dim=HD, num_hidden_layers=1, vocab_size=V, draft_vocab_size=VD,
                rms_norm_eps=EPS, max_position_embeddings=2048, hidden_act="silu",
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                torch_dtype="float16", use_cache=True, initializer_range=0.02)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return path


def test_reference_llama31_layout_decodes_losslessly(llama31, tmp_path):
  """The official Llama-3.1 EAGLE-3 layout next to a Llama-3.1-style target: it loads, matches
  SpecForge's forward, and speculative decoding with it gives exactly `ar`'s greedy output."""
  path = _llama31_reference_layout(llama31, str(tmp_path / "eagle3-llama31"))
  drafter = drafter_io.load_drafter(path, target=llama31.ours)
  assert (drafter.spec.rope_theta, drafter.spec.rope_scaling) == (10000.0, None)
  assert drafter.draft_vocab_size == VD
  model = _specforge_load(path, dtype=torch.float32)
  with torch.no_grad():
    model.embed_tokens.weight.copy_(llama31.hf.model.embed_tokens.weight)
  _eagle3_compare(llama31, drafter, model, seed=13)
  prompts = [_prompt(1)[:6], _prompt(2)[:9]]
  ar = generate(llama31.ours, prompts, max_new_tokens=12, mode="ar")
  # Every draft verified (no cost-based skipping): the drafts are really tried.
  out = generate(llama31.ours, prompts, max_new_tokens=12, mode="sd", drafter=drafter,
                 schedule="off")
  assert out.tokens == ar.tokens
  assert out.total.verified == out.total.drafted > 0


# -------------------------------------------------------- DFlash family
DFLASH_TAPS = [1, 3, 5]
BLOCK = 5  # the upstream block: the anchor and 4 masks
MASK_ID = V - 1


def _block_config(target_family: str, arch: str, *, own_rope: bool = False,
                  **dflash) -> Qwen3Config:
  """A drafter config as z-lab / SpecForge write them: Qwen3 layers, the target's RoPE copied
  (`own_rope`: theta 10000 of its own instead)."""
  rope = (dict(rope_theta=500000.0, rope_scaling=dict(LLAMA31_ROPE)) if target_family == "llama31"
          else dict(rope_theta=1000000.0))
  if own_rope:
    rope = dict(rope_theta=10000.0)
  return Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=2,
                     num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                     rms_norm_eps=EPS, max_position_embeddings=128, tie_word_embeddings=False,
                     architectures=[arch], block_size=BLOCK, num_target_layers=L,
                     dflash_config=dict(mask_token_id=MASK_ID, target_layer_ids=DFLASH_TAPS,
                                        **dflash), **rope)


def _f32_stage_hidden(drafter, state, gamma):
  """A stage's outputs [B, gamma, D] with the f32 parameters (a generation drafts with 16-bit
  copies of the layers, `BlockDrafter.draft_layer_dtype`: compared as drafts only)."""
  n = state.lengths
  x = drafter.stage_inputs(state.anchor, gamma)[:, None]
  positions = (n[:, None] + jnp.arange(x.shape[2])[None, :])[:, None]
  ctx_mask = (jnp.arange(state.k.shape[2])[None, :] < n[:, None])[:, None]
  return drafter.run_blocks(x, positions=positions, ctx_k=state.k, ctx_v=state.v,
                            ctx_mask=ctx_mask)[:, 0, -gamma:]


@nnx.jit(static_argnums=3)
def _block_program(drafter, features, next_tokens, gamma):
  """Block drafter: the logits of a stage's block [gamma, V] and its greedy drafts."""
  state = _commit(drafter, features, next_tokens)
  h = _f32_stage_hidden(drafter, state, gamma)
  _, stage = drafter.draft_stage(state, key=jax.random.key(0), block_size=gamma, sampling=GREEDY)
  return drafter.draft_logits(h)[0], stage.tokens[0]


@nnx.jit(static_argnums=3)
def _domino_program(drafter, features, next_tokens, gamma):
  """Domino: corrected logits given the drafts before each position [gamma, V], greedy drafts."""
  state = _commit(drafter, features, next_tokens)
  _, stage = drafter.draft_stage(state, key=jax.random.key(0), block_size=gamma, sampling=GREEDY)
  h = _f32_stage_hidden(drafter, state, gamma)
  prev = jnp.concatenate([state.anchor[:, None], stage.tokens[:, :-1]], axis=1)
  _, logits = drafter.corrected_logits(h, prev)
  return logits[0], stage.tokens[0]


def _block_upstream(model, target: Target, features: np.ndarray, anchor: int):
  """One upstream block forward over the committed context: [anchor, mask x (B - 1)] at
  positions N .. N + B - 1, the context's keys at 0 .. N - 1, non-causal (as in
  `dflash_generate` / `spec_generate`). Returns the normed outputs [B, D]."""
  with torch.no_grad():
    block = torch.as_tensor([[anchor] + [MASK_ID] * (BLOCK - 1)])
    noise = target.hf.model.embed_tokens(block)
    ctx = torch.as_tensor(features).reshape(1, len(features), -1)
    out = model(position_ids=torch.arange(len(features) + BLOCK)[None], noise_embedding=noise,
                target_hidden=ctx, is_causal=False)
  return out


def _dflash_compare(target: Target, drafter, model, *, seed: int):
  """DFlash: drafts = the target's head over outputs 1 .. B - 1 (each its own position)."""
  prompt = _prompt(seed)
  features = target.taps(prompt, DFLASH_TAPS)
  anchor = target.greedy_next(prompt)
  hidden = _block_upstream(model, target, features, anchor)[:, 1:]
  with torch.no_grad():
    want_logits = target.hf.lm_head(hidden)[0].numpy()
  logits, got = _block_program(drafter, jnp.asarray(features),
                               jnp.asarray(prompt[1:] + [anchor], jnp.int32), BLOCK - 1)
  np.testing.assert_allclose(np.asarray(logits), want_logits, **TOL)
  assert np.asarray(got).tolist() == want_logits.argmax(-1).tolist()


UPSTREAM_DFLASH = {"zlab": zlab_dflash.DFlashDraftModel, "specforge": SFDFlash}


@pytest.mark.parametrize("family,upstream,own_rope", [("qwen3", "zlab", False),
                                                     ("llama31", "specforge", False),
                                                     ("llama31", "zlab", True)])
def test_upstream_dflash_loads_into_ours(request, tmp_path, family, upstream, own_rope):
  target = request.getfixturevalue(family)
  model = UPSTREAM_DFLASH[upstream](_block_config(family, "DFlashDraftModel", own_rope=own_rope))
  _randomize(model, seed=31)
  model.eval().save_pretrained(str(tmp_path / "up"))
  drafter = drafter_io.load_drafter(str(tmp_path / "up"), target=target.ours)
  # Its RoPE is its config's: the target's as z-lab's drafters copy it (none of its own), or
  # its own.
  assert drafter.spec.rope_theta == (10000.0 if own_rope else None)
  assert list(drafter.taps) == DFLASH_TAPS
  _dflash_compare(target, drafter, model, seed=32)


@pytest.mark.parametrize("upstream", ["zlab", "specforge"])
def test_our_block_drafter_loads_into_upstream_dflash(qwen3, tmp_path, upstream):
  drafter = build_drafter({"kind": "block", "num_layers": 2, "num_heads": HEADS,
                           "num_kv_heads": KV, "head_dim": HD, "intermediate_size": FF,
                           "taps": DFLASH_TAPS, "mask_token_id": MASK_ID,
                           "block_size": BLOCK - 1}, target=qwen3.ours, rngs=nnx.Rngs(33))
  drafter.wo[...] = drafter.wo[...] * 4.0
  path = drafter_io.export_drafter(drafter, tmp_path / "ours", format="hf")
  model = UPSTREAM_DFLASH[upstream].from_pretrained(path).eval()
  _dflash_compare(qwen3, drafter, model, seed=34)


DOMINO = dict(projector_type="domino", emb_dim=24, gru_hidden_dim=16, pure_draft_prefix_len=1,
              shift_label=True)


def _domino_compare(target: Target, drafter, model, *, seed: int):
  """Domino (shifted): SpecForge's sampling loop drafts B - 1 tokens from outputs 0 .. B - 2
  with its GRU correction; ours drafts B, the first B - 1 compared with the logits behind them."""
  prompt = _prompt(seed)
  features = target.taps(prompt, DFLASH_TAPS)
  anchor = target.greedy_next(prompt)
  hidden = _block_upstream(model, target, features, anchor)
  block = torch.as_tensor([[anchor] + [MASK_ID] * (BLOCK - 1)])
  with torch.no_grad():
    drafts = model._sample_draft_tokens(target.hf, hidden, block)  # pylint: disable=protected-access
    completed = torch.cat([block[:, :1], drafts], dim=1)
    want_logits = model.apply_logits_head(
        target.hf.lm_head(hidden)[:, None],
        prev_token_embeddings=target.hf.model.embed_tokens(completed)[:, None],
        hidden_states=hidden[:, None])[0, 0, :BLOCK - 1].numpy()
  logits, got = _domino_program(drafter, jnp.asarray(features),
                                jnp.asarray(prompt[1:] + [anchor], jnp.int32), BLOCK)
  np.testing.assert_allclose(np.asarray(logits)[:BLOCK - 1], want_logits, **TOL)
  assert np.asarray(got).tolist()[:BLOCK - 1] == drafts[0].tolist()


def test_specforge_domino_loads_into_ours(qwen3, tmp_path):
  model = SFDomino(_block_config("qwen3", "DominoDraftModel", **DOMINO))
  _randomize(model, seed=41)
  model.eval().save_pretrained(str(tmp_path / "up"))
  with open(tmp_path / "up" / "config.json") as f:
    assert "emb_dim" not in json.load(f)  # SpecForge keeps it in dflash_config only
  drafter = drafter_io.load_drafter(str(tmp_path / "up"), target=qwen3.ours)
  assert drafter.spec.correction_rank == 24 and drafter.spec.gru_hidden_size == 16
  _domino_compare(qwen3, drafter, model, seed=42)


def test_our_domino_export_loads_into_specforge(qwen3, tmp_path):
  drafter = build_drafter({"kind": "domino", "num_layers": 2, "num_heads": HEADS,
                           "num_kv_heads": KV, "head_dim": HD, "intermediate_size": FF,
                           "taps": DFLASH_TAPS, "mask_token_id": MASK_ID, "block_size": BLOCK,
                           "gru_hidden_size": 16, "correction_rank": 24},
                          target=qwen3.ours, rngs=nnx.Rngs(43))
  drafter.correction_w2[...] = 0.5 * jax.random.normal(jax.random.key(1),
                                                        drafter.correction_w2[...].shape)
  path = drafter_io.export_drafter(drafter, tmp_path / "ours", format="hf")
  model = _specforge_load(path)
  assert isinstance(model, SFDomino) and model.shift_label and model.pure_draft_prefix_len == 1
  _domino_compare(qwen3, drafter, model, seed=44)


def test_specforge_dspark_is_refused_with_the_reason(qwen3, tmp_path):
  """SpecForge's DSparkDraftModel is another layout than DeepSpec's (which ours reads)."""
  from specforge.modeling.draft.dspark import DSparkDraftModel  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import CheckpointFormatError  # pylint: disable=g-import-not-at-top

  model = DSparkDraftModel(_block_config("qwen3", "DSparkDraftModel", markov_rank=8,
                                         enable_confidence_head=True))
  model.save_pretrained(str(tmp_path / "up"))
  with pytest.raises(CheckpointFormatError, match="DSparkDraftModel.*unshifted"):
    drafter_io.load_drafter(str(tmp_path / "up"), target=qwen3.ours)
