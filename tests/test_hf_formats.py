"""Public drafter checkpoints (EAGLE-3, DFlash, DSpark, Domino Hugging Face layouts): read,
write, check.

Checkpoints are written here in the reference layouts with torch, and their
forward is re-implemented here in PyTorch from the reference description
(`[out, in]` weights, HF RoPE, offsets in d2t), independently of our code.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from flax import nnx

import drafter_programs
from dloop_jax import flat_state
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.drafters import build_drafter
from dloop_jax.drafters import hf_format
from dloop_jax.drafters import io as drafter_io
from dloop_jax.drafters import variables
from dloop_jax.errors import (CheckpointFormatError, ConfigError, DrafterMismatchError,
                              ModelLoadError)
from dloop_jax.models.transformer import tiny_target

torch.set_num_threads(1)  # see model_fixtures

# The tiny target: 4 layers, D 32, vocab 64, RoPE theta 10000, eps 1e-5. The
# checkpoints use their own attention shape (2 heads / 1 kv head of 16, MLP 48).
V, D, L = 64, 32, 4
HEADS, KV, HD, FF = 2, 1, 16, 48
EPS, THETA = 1e-5, 10000.0
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
  return tiny_target(seed=3, num_layers=L)


# ------------------------------------------------------------ checkpoints
def _layer_tensors(gen, prefix: str, in_dim: int, *, qk_norm: bool) -> dict[str, torch.Tensor]:
  def w(*shape):
    return 0.2 * torch.randn(*shape, generator=gen)

  def norm(n):
    return 1.0 + 0.1 * torch.randn(n, generator=gen)

  out = {
      prefix + "self_attn.q_proj.weight": w(HEADS * HD, in_dim),
      prefix + "self_attn.k_proj.weight": w(KV * HD, in_dim),
      prefix + "self_attn.v_proj.weight": w(KV * HD, in_dim),
      prefix + "self_attn.o_proj.weight": w(D, HEADS * HD),
      prefix + "mlp.gate_proj.weight": w(FF, D),
      prefix + "mlp.up_proj.weight": w(FF, D),
      prefix + "mlp.down_proj.weight": w(D, FF),
      prefix + "input_layernorm.weight": norm(D),
      prefix + "post_attention_layernorm.weight": norm(D),
  }
  if qk_norm:
    out[prefix + "self_attn.q_norm.weight"] = norm(HD)
    out[prefix + "self_attn.k_norm.weight"] = norm(HD)
  return out


def _save(path, config: dict, tensors: dict[str, torch.Tensor], *, fmt: str) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if fmt == "bin":
    torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
  elif fmt == "bin_sharded":
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
      torch.save({k: tensors[k] for k in keys}, os.path.join(path, file))
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
      json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
  else:
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                os.path.join(path, "model.safetensors"))
  return str(path)


def eagle3_checkpoint(path, *, draft_vocab: int = 48, prefix: str = "midlayer.",
                      fmt: str = "safetensors", maps: bool = True, taps=(0, 2, 3),
                      dtype=torch.float32, seed: int = 0, **config_overrides):
  """Writes an EAGLE-3 drafter as SpecForge / SafeAILab do; returns (dir, f32 tensors)."""
  gen = torch.Generator().manual_seed(seed)
  tensors = _layer_tensors(gen, prefix, 2 * D, qk_norm=False)
  tensors[prefix + "hidden_norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
  tensors["fc.weight"] = 0.2 * torch.randn(D, len(taps) * D, generator=gen)
  tensors["norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
  tensors["lm_head.weight"] = 0.3 * torch.randn(draft_vocab, D, generator=gen)
  tensors = {k: v.to(dtype) for k, v in tensors.items()}
  if maps:
    used = np.sort(np.random.default_rng(seed).choice(V, draft_vocab, replace=False))
    tensors["d2t"] = torch.as_tensor(used - np.arange(draft_vocab), dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.as_tensor(used)] = True
    tensors["t2d"] = t2d
  config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=D,
                intermediate_size=FF, num_attention_heads=HEADS, num_key_value_heads=KV,
                head_dim=HD, num_hidden_layers=1, vocab_size=V, draft_vocab_size=draft_vocab,
                rms_norm_eps=EPS, max_position_embeddings=256, hidden_act="silu",
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(taps)})
  config.update(config_overrides)  # rope_theta absent: the reference default, 10000
  _save(path, config, tensors, fmt=fmt)
  return str(path), {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}


def _backbone(gen, *, layers: int, taps) -> tuple[dict, dict]:
  """The DFlash backbone's tensors and config.json fields (DSpark and Domino share them)."""
  tensors = {}
  for i in range(layers):
    tensors.update(_layer_tensors(gen, f"layers.{i}.", D, qk_norm=True))
  tensors["fc.weight"] = 0.2 * torch.randn(D, len(taps) * D, generator=gen)
  tensors["hidden_norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
  tensors["norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
  config = dict(model_type="qwen3", hidden_size=D, intermediate_size=FF,
                num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                num_hidden_layers=layers, vocab_size=V, rms_norm_eps=EPS, rope_theta=THETA,
                max_position_embeddings=256, num_target_layers=L)
  return tensors, config


def dflash_checkpoint(path, *, layers: int = 2, block_size: int = 5, mask_token_id: int = 63,
                      taps=(0, 1, 2), seed: int = 0, **config_overrides):
  """Writes a DFlash drafter as z-lab does; returns (dir, tensors)."""
  tensors, config = _backbone(torch.Generator().manual_seed(seed), layers=layers, taps=taps)
  config.update(architectures=["DFlashDraftModel"], block_size=block_size,
                dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(taps)})
  config.update(config_overrides)
  return _save(path, config, tensors, fmt="safetensors"), tensors


def dspark_checkpoint(path, target, *, block_size: int = 4, mask_token_id: int = 62,
                      taps=(0, 1, 2), rank: int = 8, seed: int = 0, with_markov: bool = True,
                      **config_overrides):
  """Writes a DSpark drafter as DeepSpec does (frozen copies of the target's embedding and
  head included; `deepspec/modeling/dspark/qwen3/config.py` and `modeling.py`: the fields its
  model asserts, a confidence head over [z ; W1[prev]] or, without `with_markov`, z alone);
  returns (dir, tensors)."""
  gen = torch.Generator().manual_seed(seed)
  tensors, config = _backbone(gen, layers=2, taps=taps)
  tensors.update({
      "markov_head.markov_w1.weight": 0.5 * torch.randn(V, rank, generator=gen),
      "markov_head.markov_w2.weight": 0.5 * torch.randn(V, rank, generator=gen),
      "confidence_head.proj.weight": 0.3 * torch.randn(1, D + (rank if with_markov else 0),
                                                       generator=gen),
      "confidence_head.proj.bias": 0.1 * torch.randn(1, generator=gen),
      "embed_tokens.weight": torch.as_tensor(np.array(target.embed[...])),
      "lm_head.weight": torch.as_tensor(np.array(target.lm_head[...])).T.contiguous(),
  })
  config.update(architectures=["Qwen3DSparkModel"], block_size=block_size,
                mask_token_id=mask_token_id, target_layer_ids=list(taps), markov_rank=rank,
                markov_head_type="vanilla", enable_confidence_head=True,
                confidence_head_with_markov=with_markov, num_anchors=512,
                layer_types=["full_attention"] * 2)
  config.update(config_overrides)
  return _save(path, config, tensors, fmt="safetensors"), tensors


def domino_checkpoint(path, *, block_size: int = 4, mask_token_id: int = 61, taps=(0, 1, 2),
                      gru: int = 12, rank: int = 10, prefix: str = "", seed: int = 0,
                      **options):
  """Writes a Domino drafter as Domino / SpecForge do; returns (dir, tensors without prefix)."""
  gen = torch.Generator().manual_seed(seed)
  tensors, config = _backbone(gen, layers=2, taps=taps)
  head = {
      "prefix_gru.weight_ih_l0": 0.4 * torch.randn(3 * gru, D, generator=gen),
      "prefix_gru.weight_hh_l0": 0.4 * torch.randn(3 * gru, gru, generator=gen),
      "embed_proj.0.weight": 0.4 * torch.randn(rank, D + gru, generator=gen),
      "embed_proj.2.weight": 0.4 * torch.randn(V, rank, generator=gen),
  }
  dflash = {"mask_token_id": mask_token_id, "target_layer_ids": list(taps),
            "projector_type": "domino", "pure_draft_prefix_len": 1, "gru_hidden_dim": gru,
            "shift_label": True, **options}
  config.update(architectures=["DominoDraftModel"], block_size=block_size, emb_dim=rank,
                dflash_config=dflash)
  _save(path, config, {**tensors, **{prefix + k: v for k, v in head.items()}}, fmt="safetensors")
  return str(path), {**tensors, **head}


# ------------------------------------------------- reference forward (torch)
def _rms(x, w):
  return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, positions):
  """HF rotate-half RoPE: x [T, n, hd] at integer positions [T]."""
  inv = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
  angles = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv[None]
  emb = torch.cat([angles, angles], -1)
  cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
  x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
  return x * cos + torch.cat([-x2, x1], -1) * sin


def _attend(q, k, v, mask):
  """q [Tq, n, hd] over k, v [Tk, kv, hd] (kv heads repeated as HF's repeat_kv), mask [Tq, Tk]."""
  k = k.repeat_interleave(HEADS // KV, dim=1)
  v = v.repeat_interleave(HEADS // KV, dim=1)
  s = torch.einsum("qnh,knh->nqk", q, k) / HD ** 0.5
  s = s.masked_fill(~mask[None], float("-inf"))
  return torch.einsum("nqk,knh->qnh", s.softmax(-1), v).reshape(q.shape[0], HEADS * HD)


def _mlp(x, w, p):
  return F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"]))
                  * F.linear(x, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])


class Eagle3Reference:
  """EAGLE-3's forward: [input_layernorm(emb) ; hidden_norm(h)] -> one Llama layer."""

  def __init__(self, w, embed, prefix="midlayer."):
    self.w, self.embed, self.p = w, torch.as_tensor(np.array(embed)), prefix
    self.k, self.v, self.pos = [], [], []

  def layer(self, h, tokens, positions):
    w, p = self.w, self.p
    x = torch.cat([_rms(self.embed[tokens], w[p + "input_layernorm.weight"]),
                   _rms(h, w[p + "hidden_norm.weight"])], -1)
    t = x.shape[0]
    q = _rope(F.linear(x, w[p + "self_attn.q_proj.weight"]).view(t, HEADS, HD), positions)
    self.k.append(_rope(F.linear(x, w[p + "self_attn.k_proj.weight"]).view(t, KV, HD), positions))
    self.v.append(F.linear(x, w[p + "self_attn.v_proj.weight"]).view(t, KV, HD))
    self.pos += list(positions)
    mask = torch.as_tensor(positions)[:, None] >= torch.as_tensor(self.pos)[None]
    h = h + F.linear(_attend(q, torch.cat(self.k), torch.cat(self.v), mask),
                     w[p + "self_attn.o_proj.weight"])
    return h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"]), w, p)

  def logits(self, h):
    return F.linear(_rms(h, self.w["norm.weight"]), self.w["lm_head.weight"])

  def run(self, features, next_tokens, num_drafts):
    """Logits at every committed pair [T, Vd], then greedy drafts (target ids) and logprobs."""
    t = features.shape[0]
    h = F.linear(torch.as_tensor(features).reshape(t, -1), self.w["fc.weight"])
    out = self.layer(h, torch.as_tensor(next_tokens), list(range(t)))
    all_logits = self.logits(out)
    hid, drafts, logprobs = out[-1:], [], []
    d2t = self.w.get("d2t")
    for i in range(num_drafts):
      lg = self.logits(hid)[0]
      d = int(lg.argmax())
      tid = d + int(d2t[d]) if d2t is not None else d
      drafts.append(tid)
      logprobs.append(float(lg.log_softmax(-1)[d]))
      hid = self.layer(hid, torch.tensor([tid]), [t + i])
    return all_logits.numpy(), drafts, np.array(logprobs)


def dflash_reference(w, *, embed, head, features, anchor, block_size, mask_token_id, layers):
  """DFlash's block forward over target context at positions < n: logits [B - 1, V]."""
  out = _dflash_hidden(w, embed=embed, features=features, layers=layers,
                       tokens=[anchor] + [mask_token_id] * (block_size - 1))
  return (out[1:] @ torch.as_tensor(np.array(head))).numpy()


def _dflash_hidden(w, *, embed, features, tokens, layers):
  """DFlash's backbone over target context at positions < n: final-norm outputs [len(tokens), D]."""
  embed = torch.as_tensor(np.array(embed))
  n, b = features.shape[0], len(tokens)
  ctx = _rms(F.linear(torch.as_tensor(features).reshape(n, -1), w["fc.weight"]),
             w["hidden_norm.weight"])
  h = embed[torch.tensor(tokens)]
  pos_q, pos_k = list(range(n, n + b)), list(range(n + b))
  full = torch.ones(b, n + b, dtype=torch.bool)
  for i in range(layers):
    p = f"layers.{i}."
    x = _rms(h, w[p + "input_layernorm.weight"])
    kv_in = torch.cat([ctx, x])  # the context skips input_layernorm
    q = _rms(F.linear(x, w[p + "self_attn.q_proj.weight"]).view(b, HEADS, HD),
             w[p + "self_attn.q_norm.weight"])
    k = _rms(F.linear(kv_in, w[p + "self_attn.k_proj.weight"]).view(-1, KV, HD),
             w[p + "self_attn.k_norm.weight"])
    v = F.linear(kv_in, w[p + "self_attn.v_proj.weight"]).view(-1, KV, HD)
    h = h + F.linear(_attend(_rope(q, pos_q), _rope(k, pos_k), v, full),
                     w[p + "self_attn.o_proj.weight"])
    h = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"]), w, p)
  return _rms(h, w["norm.weight"])


def dspark_reference(w, *, features, anchor, block_size, mask_token_id):
  """DSpark's greedy block: [anchor, mask x (B - 1)], all B outputs drafts, each with the
  Markov bias of the token before it and a confidence. Returns (logits [B, V], tokens, conf)."""
  z = _dflash_hidden(w, embed=w["embed_tokens.weight"], features=features,
                     tokens=[anchor] + [mask_token_id] * (block_size - 1), layers=2)
  base = F.linear(z, w["lm_head.weight"])
  w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
  prev, logits, tokens, conf = anchor, [], [], []
  for k in range(block_size):
    lg = base[k] + F.linear(w1[prev], w2)
    proj = w["confidence_head.proj.weight"]
    feats = torch.cat([z[k], w1[prev]]) if proj.shape[1] > z.shape[1] else z[k]
    c = torch.sigmoid(F.linear(feats, proj, w["confidence_head.proj.bias"]))
    prev = int(lg.argmax())
    logits.append(lg)
    tokens.append(prev)
    conf.append(float(c))
  return torch.stack(logits).numpy(), tokens, np.array(conf)


def domino_reference(w, *, embed, head, features, anchor, block_size, mask_token_id):
  """Domino's greedy block: a bias-free torch GRU over the realised tokens (anchor first)
  corrects every output but the first. Returns (logits [B, V], tokens)."""
  embed = torch.as_tensor(np.array(embed))
  z = _dflash_hidden(w, embed=embed, features=features,
                     tokens=[anchor] + [mask_token_id] * (block_size - 1), layers=2)
  base = z @ torch.as_tensor(np.array(head))
  g = w["prefix_gru.weight_hh_l0"].shape[1]
  gru = torch.nn.GRU(D, g, bias=False, batch_first=True)
  with torch.no_grad():
    gru.weight_ih_l0.copy_(w["prefix_gru.weight_ih_l0"])
    gru.weight_hh_l0.copy_(w["prefix_gru.weight_hh_l0"])
    _, s = gru(embed[anchor][None, None])
    logits, tokens = [], []
    for i in range(block_size):
      lg = base[i]
      if i:
        x = torch.cat([z[i], s[0, 0]])
        lg = lg + F.linear(F.silu(F.linear(x, w["embed_proj.0.weight"])),
                           w["embed_proj.2.weight"])
      token = int(lg.argmax())
      logits.append(lg)
      tokens.append(token)
      _, s = gru(embed[token][None, None], s)
  return torch.stack(logits).numpy(), tokens


# ----------------------------------------------------------- our forwards
def _features(seed, n, n_taps):
  return np.random.default_rng(seed).normal(size=(n, n_taps, D)).astype(np.float32)


def _commit(drafter, features, next_tokens, capacity=24):
  return drafter_programs.commit(drafter, features, next_tokens, capacity)


def _eagle3_ours(drafter, features, next_tokens, num_drafts):
  """Our logits at every pair but the last (training-time test step 0), the last, and drafts."""
  logits, tokens, logprobs = drafter_programs.eagle3_program(
      drafter, jnp.asarray(features), jnp.asarray(next_tokens, jnp.int32), num_drafts, 24)
  return np.asarray(logits), np.asarray(tokens).tolist(), np.asarray(logprobs)


def _block_ours(drafter, features, next_tokens, gamma):
  """Our block logits [gamma, V] and greedy drafts after committing the context."""
  logits, tokens = _block_program(drafter, jnp.asarray(features), jnp.asarray(next_tokens), gamma)
  return np.asarray(logits), np.asarray(tokens).tolist()


@nnx.jit(static_argnums=3)
def _block_program(drafter, features, next_tokens, gamma):
  """One program per drafter shape: the tests that share a shape compile it once."""
  n = features.shape[0]
  state = _commit(drafter, features, next_tokens)
  x = drafter.block_inputs(state.anchor, gamma)[:, None]
  positions = (n + jnp.arange(gamma + 1))[None, None]
  ctx_mask = (jnp.arange(state.k.shape[2]) < n)[None, None]
  h = drafter.run_blocks(x, positions=positions, ctx_k=state.k, ctx_v=state.v,
                         ctx_mask=ctx_mask)[0, 0, 1:]
  _, stage = drafter.draft_stage(state, key=jax.random.key(0), block_size=gamma, sampling=GREEDY)
  return drafter.draft_logits(h), stage.tokens[0]


def _flat(drafter):
  _, params, _, _, state = variables.split_drafter(drafter)
  return {**{k: np.asarray(v) for k, v in flat_state.flat_values(params).items()},
          **{k: np.asarray(v) for k, v in flat_state.flat_values(state).items()}}


def _assert_same_weights(a, b):
  fa, fb = _flat(a), _flat(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@nnx.jit(static_argnums=3)
def _head_program(drafter, features, next_tokens, gamma):
  """A DSpark / Domino stage after committing the context: its greedy drafts, their
  confidences, and the logits of every position given the drafts before it [gamma, V]."""
  state = _commit(drafter, features, next_tokens)
  _, stage = drafter.draft_stage(state, key=jax.random.key(0), block_size=gamma, sampling=GREEDY)
  _, h = drafter.backbone_stage(state, gamma)
  prev = jnp.concatenate([state.anchor[:, None], stage.tokens[:, :-1]], axis=1)
  if hasattr(drafter, "markov_bias"):
    logits = drafter.head_logits(h, prev)
  else:
    _, logits = drafter.corrected_logits(h, prev)
  return logits[0], stage.tokens[0], stage.confidence


def _head_ours(drafter, features, next_tokens, gamma):
  logits, tokens, conf = _head_program(drafter, jnp.asarray(features), jnp.asarray(next_tokens),
                                       gamma)
  return np.asarray(logits), np.asarray(tokens).tolist(), (
      None if conf is None else np.asarray(conf)[0])


def _written_back_exactly(source: str, path: str, target):
  """The layout written at `path` holds `source`'s tensors bit for bit; returns it loaded."""
  written = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
  original = safetensors.torch.load_file(os.path.join(source, "model.safetensors"))
  assert sorted(written) == sorted(original)
  for k in original:
    torch.testing.assert_close(written[k], original[k], rtol=0, atol=0, msg=k)
  return drafter_io.load_drafter(path, target=target)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("variant", ["safetensors", "bin_fp16_layers0", "bin_sharded_bf16",
                                     "full_vocab_no_maps"])
def test_eagle3_checkpoint_matches_reference_forward(target, tmp_path, variant):
  kw = dict(safetensors={},
            bin_fp16_layers0=dict(fmt="bin", dtype=torch.float16, prefix="layers.0."),
            bin_sharded_bf16=dict(fmt="bin_sharded", dtype=torch.bfloat16),
            full_vocab_no_maps=dict(draft_vocab=V, maps=False))[variant]
  path, w = eagle3_checkpoint(tmp_path / "eagle3", seed=1, **kw)
  drafter = drafter_io.load_drafter(path, target=target)
  assert drafter.taps == (0, 2, 3) and drafter.spec.kind == "eagle3"
  assert drafter.reduced_vocab == (variant != "full_vocab_no_maps")
  features = _features(0, 7, 3)
  next_tokens = np.random.default_rng(1).integers(0, V, 7)
  ref = Eagle3Reference(w, target.embed[...], prefix=kw.get("prefix", "midlayer."))
  want_logits, want_drafts, want_lp = ref.run(features, next_tokens, 4)
  logits, drafts, lp = _eagle3_ours(drafter, features, next_tokens, 4)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  assert drafts == want_drafts
  np.testing.assert_allclose(lp, want_lp, rtol=1e-5, atol=1e-5)


def test_eagle3_default_taps_and_own_embedding(target, tmp_path):
  """No eagle_config: `default_taps` ({1, L//2 - 1, L - 4}, clipped: (0, 1) here); a shipped
  embed_tokens replaces the target's."""
  path, w = eagle3_checkpoint(tmp_path / "e", taps=(0, 1), eagle_config=None)
  embed = np.random.default_rng(5).normal(size=(V, D)).astype(np.float32)
  tensors = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
  tensors["embed_tokens.weight"] = torch.as_tensor(embed)
  safetensors.torch.save_file(tensors, os.path.join(path, "model.safetensors"))
  drafter = drafter_io.load_drafter(path, target=target)
  assert drafter.taps == (0, 1)
  np.testing.assert_array_equal(np.asarray(drafter.embed[...]), embed)
  features = _features(2, 5, 2)
  next_tokens = np.arange(5) + 3
  want = Eagle3Reference(w, embed).run(features, next_tokens, 2)
  got = _eagle3_ours(drafter, features, next_tokens, 2)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  assert got[1] == want[1]


def test_dflash_checkpoint_matches_reference_forward(target, tmp_path):
  path, w = dflash_checkpoint(tmp_path / "dflash", block_size=5, mask_token_id=63)
  drafter = drafter_io.load_drafter(path, target=target)
  assert drafter.spec.kind == "block" and drafter.block_size == 4 and drafter.taps == (0, 1, 2)
  # DFlash's mask: the token's frozen embedding, not a parameter.
  assert drafter.spec.mask_token_id == 63 and drafter.mask_embed is None
  np.testing.assert_array_equal(np.asarray(drafter.mask_input()),
                                np.asarray(target.embed[...][63]))
  features = _features(3, 6, 3)
  next_tokens = np.random.default_rng(2).integers(0, V, 6)
  want = dflash_reference(w, embed=target.embed[...], head=target.lm_head[...],
                          features=features, anchor=int(next_tokens[-1]), block_size=5,
                          mask_token_id=63, layers=2)
  logits, drafts = _block_ours(drafter, features, next_tokens, 4)
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  assert drafts == want.argmax(-1).tolist()


def test_eagle3_round_trip_generates_the_same(target, tmp_path):
  drafter = build_drafter({"kind": "eagle3", "draft_vocab_size": 40, "taps": [0, 1, 3]},
                          target=target, rngs=nnx.Rngs(4))
  drafter.set_draft_vocab(np.sort(np.random.default_rng(0).choice(V, 40, replace=False)),
                          target=target)
  path = drafter_io.export_drafter(drafter, tmp_path / "hf", target_name="tiny", format="hf")
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["LlamaForCausalLMEagle3"]
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
  tensors = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
  d2t = np.asarray(drafter.d2t[...])
  np.testing.assert_array_equal(tensors["d2t"].numpy() + np.arange(40), d2t)  # offsets
  assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
  assert int(tensors["t2d"].sum()) == 40 and tensors["midlayer.self_attn.q_proj.weight"].shape == (
      drafter.spec.q_size, 2 * D)
  loaded = drafter_io.load_drafter(path, target=target)
  _assert_same_weights(drafter, loaded)
  assert loaded.spec == drafter.spec
  prompts = [[1, 5, 9, 2], [3, 4]]
  outs = [generate(target, prompts, max_new_tokens=12, mode="dloop", drafter=d, gate=float("-inf"),
                   max_stages=2, schedule="off") for d in (drafter, loaded)]
  assert outs[0].tokens == outs[1].tokens
  assert outs[0].total.accepted == outs[1].total.accepted
  assert outs[0].total.drafted == outs[1].total.drafted


def test_block_round_trip_through_the_dflash_layout(target, tmp_path):
  source, _ = dflash_checkpoint(tmp_path / "source", block_size=5, mask_token_id=11, seed=4)
  drafter = drafter_io.load_drafter(source, target=target)
  path = drafter_io.export_drafter(drafter, tmp_path / "hf", format="hf")
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["DFlashDraftModel"]
  assert config["dflash_config"]["mask_token_id"] == 11 and config["block_size"] == 5
  assert config["dflash_config"]["target_layer_ids"] == [0, 1, 2]
  loaded = _written_back_exactly(source, path, target)
  _assert_same_weights(drafter, loaded)
  assert loaded.spec == drafter.spec
  features = _features(4, 6, 3)
  next_tokens = np.arange(6) + 7
  a, b = (_block_ours(d, features, next_tokens, 4) for d in (drafter, loaded))
  np.testing.assert_array_equal(a[0], b[0])
  assert a[1] == b[1]

  # What the DFlash layout cannot hold: a learned mask vector (a draft vocabulary is
  # dropped: the drafter is written over the whole head).
  learned = build_drafter({"kind": "block", "num_layers": 1}, target=target, rngs=nnx.Rngs(5))
  with pytest.raises(CheckpointFormatError, match="mask embedding is a learned vector"):
    drafter_io.export_drafter(learned, tmp_path / "learned", format="hf")
  # A learned vector that is a row of the embedding is that row's token.
  learned.mask_embed[...] = target.embed[...][21]
  path = drafter_io.export_drafter(learned, tmp_path / "row", format="hf")
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["dflash_config"]["mask_token_id"] == 21
  reduced = build_drafter({"kind": "block", "num_layers": 1, "draft_vocab_size": 32,
                           "mask_token_id": 21}, target=target, rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match="no draft vocabulary"):
    path = drafter_io.export_drafter(reduced, tmp_path / "r", format="hf")
  whole = drafter_io.load_drafter(path, target=target)
  assert whole.spec == dataclasses.replace(reduced.spec, draft_vocab_size=0)
  for (key, a), (_, b) in zip(nnx.to_flat_state(nnx.state(reduced, nnx.Param)),
                              nnx.to_flat_state(nnx.state(whole, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(key))
  with pytest.raises(ConfigError, match="format"):
    drafter_io.export_drafter(reduced, tmp_path / "r", format="gguf")


def test_mismatched_and_broken_checkpoints(target, tmp_path):
  def edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
      config = json.load(f)
    config.update(changes)
    with open(cfg_path, "w") as f:
      json.dump(config, f)

  path, _ = eagle3_checkpoint(tmp_path / "a")
  load = lambda: drafter_io.load_drafter(path, target=target)  # noqa: E731
  edit_config(path, hidden_size=48)
  with pytest.raises(DrafterMismatchError, match="hidden_size: checkpoint has 48, target has 32"):
    load()
  edit_config(path, hidden_size=D, vocab_size=128)
  with pytest.raises(DrafterMismatchError, match="vocab_size: checkpoint has 128, target has 64"):
    load()
  edit_config(path, vocab_size=V, rms_norm_eps=1e-3)
  with pytest.raises(DrafterMismatchError, match="rms_norm_eps: checkpoint has 0.001"):
    load()
  # The drafter's own RoPE is its config's (tests/test_upstream_parity.py), never a mismatch.
  edit_config(path, rms_norm_eps=EPS, rope_theta=500000.0)
  assert load().spec.rope_theta == 500000.0
  edit_config(path, rope_theta=THETA, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})
  with pytest.raises(DrafterMismatchError, match=r"tapped layers \[9\]"):
    load()
  edit_config(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})
  with pytest.raises(CheckpointFormatError, match="fc.weight reads 3 hidden states"):
    load()
  edit_config(path, eagle_config=None, fc_norm=True)
  with pytest.raises(CheckpointFormatError, match="fc_norm"):
    load()
  edit_config(path, fc_norm=False)
  edit_config(path, eagle_config=None, architectures=["FancyDraftModel"], draft_vocab_size=None)
  with pytest.raises(CheckpointFormatError, match="FancyDraftModel"):
    load()
  edit_config(path, architectures=["DFlash2DraftModel"])
  with pytest.raises(CheckpointFormatError, match="dynamic convolutions"):
    load()

  # Tensors: missing, misshapen, unexpected, and a truncated file.
  def rewrite(**changes):
    path2, w = eagle3_checkpoint(tmp_path / "b", taps=(0, 1, 3))
    w = {**w, **changes}
    safetensors.torch.save_file({k: v for k, v in w.items() if v is not None},
                                os.path.join(path2, "model.safetensors"))
    return path2

  with pytest.raises(ModelLoadError, match="'fc.weight' is missing"):
    drafter_io.load_drafter(rewrite(**{"fc.weight": None}), target=target)
  with pytest.raises(ModelLoadError, match=r"'lm_head.weight' .* has shape \(48, 16\)"):
    drafter_io.load_drafter(rewrite(**{"lm_head.weight": torch.zeros(48, 16)}), target=target)
  with pytest.raises(ModelLoadError, match="'d2t'"):
    drafter_io.load_drafter(rewrite(d2t=None, t2d=None), target=target)
  with pytest.raises(CheckpointFormatError, match="o_proj.bias"):
    drafter_io.load_drafter(rewrite(**{"midlayer.self_attn.o_proj.bias": torch.zeros(D)}),
                            target=target)
  broken = rewrite()
  file = os.path.join(broken, "model.safetensors")
  with open(file, "r+b") as f:
    f.truncate(os.path.getsize(file) // 2)
  with pytest.raises(ModelLoadError, match="truncated or corrupt"):
    drafter_io.load_drafter(broken, target=target)
  os.remove(file)
  with pytest.raises(ModelLoadError, match="no model.safetensors"):
    drafter_io.load_drafter(broken, target=target)

  dpath, _ = dflash_checkpoint(tmp_path / "last", taps=(0, 1, 3))
  with pytest.raises(CheckpointFormatError, match=r"tap the target's last layer \(3\)"):
    drafter_io.load_drafter(dpath, target=target)
  dpath, _ = dflash_checkpoint(tmp_path / "d", taps=(0, 1, 2))
  edit_config(dpath, num_target_layers=36)
  with pytest.raises(DrafterMismatchError,
                     match="num_target_layers: checkpoint has 36, target has 4"):
    drafter_io.load_drafter(dpath, target=target)
  edit_config(dpath, num_target_layers=L, dflash_config={"mask_token_id": 63,
                                                          "target_layer_ids": [0, 1, 2],
                                                          "shift_label": True})
  with pytest.raises(CheckpointFormatError, match="shift_label"):
    drafter_io.load_drafter(dpath, target=target)
  edit_config(dpath, dflash_config={"mask_token_id": 63, "target_layer_ids": [0, 1, 2],
                                    "input_embedding_scale": 8.0})
  with pytest.raises(CheckpointFormatError, match="input_embedding_scale"):
    drafter_io.load_drafter(dpath, target=target)


def _save_target_hf(target, path) -> str:
  """Our tiny target as a Hugging Face Llama directory (the inverse of `hf_loader`)."""
  from dloop_jax.models import hf_loader  # pylint: disable=g-import-not-at-top

  c = target.config
  params = target.flat_params()
  tensors = {"model.embed_tokens.weight": params["embed"],
             "model.norm.weight": params["final_norm"],
             "lm_head.weight": params["lm_head"].T}
  roles = {v: k for k, v in hf_loader._LAYER_PARAMS.items()}  # pylint: disable=protected-access
  for role, (name, columns) in hf_loader.layer_slots(c).items():
    if name not in params:
      continue
    for i in range(c.num_layers):
      w = params[name][i] if columns is None else params[name][i][..., columns]
      tensors[f"model.layers.{i}.{roles[role]}"] = w.T if w.ndim == 2 else w
  config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
  return _save(path, config, {k: torch.as_tensor(np.array(v)) for k, v in tensors.items()},
               fmt="safetensors")


def test_export_cli_converts_both_ways(target, tmp_path):
  """`python -m train.export`: HF layout -> ours -> HF layout, for a target in a directory."""
  from train import export as export_cli  # pylint: disable=g-import-not-at-top

  target_dir = _save_target_hf(target, tmp_path / "target")
  source, _ = eagle3_checkpoint(tmp_path / "source")
  ours, again = str(tmp_path / "ours"), str(tmp_path / "again")
  assert export_cli.main(["--drafter", source, "--target", target_dir, "--out", ours]) == 0
  assert os.path.isfile(os.path.join(ours, "drafter.json"))
  assert export_cli.main(["--drafter", ours, "--target", target_dir, "--out", again,
                          "--format", "hf"]) == 0
  assert drafter_io.is_hf_dir(again)
  # Our format stores bfloat16; the HF file written from it holds those values exactly.
  _assert_same_weights(drafter_io.load_drafter(ours, target=target),
                       drafter_io.load_drafter(again, target=target))
  # Ours -> ours with int8 weights (how the shipped drafters are stored): the record travels
  # (a shipped drafter's name and rank too), the matrices are int8 on disk.
  info_path = os.path.join(ours, drafter_io.INFO_FILE)
  with open(info_path) as f:
    info = json.load(f)
  with open(info_path, "w") as f:
    json.dump(dict(info, name="shipped-name", rank=3, metrics={"tau": 1.5}), f)
  small = str(tmp_path / "int8")
  assert export_cli.main(["--drafter", ours, "--target", target_dir, "--out", small,
                          "--weights", "int8"]) == 0
  got = drafter_io.read_info(small)
  assert (got["weights"], got["name"], got["rank"], got["metrics"]) == (
      "int8", "shipped-name", 3, {"tau": 1.5})
  assert {d["dtype"] for d in got["params"].values()} == {"int8", "bfloat16"}
  assert drafter_io.load_drafter(small, target=target).drafter_config() == info["drafter_config"]
  # A checkpoint for another target: exit code 2 with the mismatch, no traceback.
  other, _ = eagle3_checkpoint(tmp_path / "other", taps=(0, 1, 7))
  assert export_cli.main(["--drafter", other, "--target", target_dir, "--out",
                          str(tmp_path / "x")]) == 2


def test_infer_prompts_file_errors_name_the_line(tmp_path, capsys):
  from infer.__main__ import main as infer_main

  bad_json = tmp_path / "bad.jsonl"
  bad_json.write_text('{"prompt": "hi"}\n\n{"prompt": "x",\n')
  assert infer_main(["--prompts-file", str(bad_json), "--mode", "ar"]) == 2
  err = capsys.readouterr().err
  assert f"{bad_json}, line 3: not valid JSON" in err and "Traceback" not in err
  no_prompt = tmp_path / "no_prompt.jsonl"
  no_prompt.write_text('{"prompt": "hi"}\n{"text": "hello"}\n')
  assert infer_main(["--prompts-file", str(no_prompt), "--mode", "ar"]) == 2
  err = capsys.readouterr().err
  assert f'{no_prompt}, line 2: expected an object with a string "prompt"' in err
  assert "['text']" in err
  missing = tmp_path / "missing.jsonl"
  assert infer_main(["--prompts-file", str(missing), "--mode", "ar"]) == 2
  assert "missing.jsonl" in capsys.readouterr().err


def test_shipped_eagle3_drafter_round_trips_through_the_hf_layout(tmp_path):
  """The shipped SmolLM2 EAGLE-3 drafter, written for SGLang / vLLM and read back: same drafts.

  The target only lends its (frozen) embedding here, which neither layout stores: a target with
  the real one's fingerprint and random embedding stands in for it (loading the real one, or
  initialising 30 layers, takes 10 s).
  """
  from dloop_jax.models.config import tiny_config  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import transformer  # pylint: disable=g-import-not-at-top

  config = tiny_config(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, intermediate_size=64, name="smollm2-135m")
  rng = np.random.default_rng(0)
  real = transformer.Transformer.from_params(config, {
      k: rng.normal(size=shape).astype(np.float32) if k == "embed" else np.zeros(shape, np.float32)
      for k, shape in transformer.param_shapes(config).items()})
  name = "smollm2-135m-instruct-eagle3"
  drafter = drafter_io.load_drafter(name, target=real)
  path = drafter_io.export_drafter(drafter, tmp_path / "hf", target_name="smollm2-135m-instruct",
                                   format="hf")
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert config["draft_vocab_size"] == 8192 and config["vocab_size"] == 49152
  loaded = drafter_io.load_drafter(path, target=real)
  _assert_same_weights(drafter, loaded)
  # One drafting stage on the same features: the same drafts, bit for bit.
  features = np.random.default_rng(0).normal(size=(6, 3, 576)).astype(np.float32)
  next_tokens = np.array([1, 504, 28, 3391, 17, 2])
  stages = [_stage(d, features, next_tokens) for d in (drafter, loaded)]
  np.testing.assert_array_equal(stages[0][0], stages[1][0])
  np.testing.assert_array_equal(stages[0][1], stages[1][1])


def _stage(drafter, features, next_tokens):
  state = _commit(drafter, features, next_tokens, capacity=features.shape[0] + 8)
  _, stage = nnx.jit(lambda d, s: d.draft_stage(s, key=jax.random.key(0), block_size=4,
                                                sampling=GREEDY))(drafter, state)
  return np.asarray(stage.tokens), np.asarray(stage.logprobs)


@pytest.mark.parametrize("with_markov", [True, False])
def test_dspark_checkpoint_matches_reference_forward(target, tmp_path, with_markov):
  path, w = dspark_checkpoint(tmp_path / "dspark", target, block_size=4, mask_token_id=62,
                              with_markov=with_markov)
  drafter = drafter_io.load_drafter(path, target=target)
  drafter.draft_layer_dtype = None  # the reference computes in f32 (drafting reads bf16)
  assert drafter.spec.kind == "dspark" and drafter.block_size == 4 and drafter.taps == (0, 1, 2)
  assert drafter.spec.markov_rank == 8 and drafter.spec.enable_confidence_head
  assert drafter.spec.confidence_head_with_markov is with_markov
  features = _features(5, 6, 3)
  next_tokens = np.random.default_rng(3).integers(0, V, 6)
  want_logits, want_tokens, want_conf = dspark_reference(
      w, features=features, anchor=int(next_tokens[-1]), block_size=4, mask_token_id=62)
  logits, tokens, conf = _head_ours(drafter, features, next_tokens, 4)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  assert tokens == want_tokens
  np.testing.assert_allclose(conf, want_conf, rtol=1e-5, atol=1e-6)


def test_domino_checkpoint_matches_reference_forward(target, tmp_path):
  # Older files keep the head under `logit_head.`.
  path, w = domino_checkpoint(tmp_path / "domino", block_size=4, mask_token_id=61,
                              prefix="logit_head.")
  drafter = drafter_io.load_drafter(path, target=target)
  drafter.draft_layer_dtype = None  # the reference computes in f32 (drafting reads bf16)
  assert drafter.spec.kind == "domino" and drafter.block_size == 4
  assert (drafter.spec.gru_hidden_size, drafter.spec.correction_rank) == (12, 10)
  features = _features(6, 6, 3)
  next_tokens = np.random.default_rng(4).integers(0, V, 6)
  want_logits, want_tokens = domino_reference(
      w, embed=target.embed[...], head=target.lm_head[...], features=features,
      anchor=int(next_tokens[-1]), block_size=4, mask_token_id=61)
  logits, tokens, _ = _head_ours(drafter, features, next_tokens, 4)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  assert tokens == want_tokens


@pytest.mark.parametrize("kind", ["dspark", "dspark_plain_confidence", "domino"])
def test_head_drafters_round_trip_through_their_layouts(target, tmp_path, kind):
  if kind.startswith("dspark"):
    source, _ = dspark_checkpoint(tmp_path / "source", target, seed=2,
                                  with_markov=kind == "dspark")
  else:
    source, _ = domino_checkpoint(tmp_path / "source", seed=2)
  drafter = drafter_io.load_drafter(source, target=target)
  path = drafter_io.export_drafter(drafter, tmp_path / "hf", format="hf")
  config = json.load(open(os.path.join(path, "config.json")))
  assert hf_format.detect_kind(config) == kind.split("_")[0]
  assert config["layer_types"] == ["full_attention"] * 2
  if kind.startswith("dspark"):
    # Every field DeepSpec's Qwen3DSparkModel asserts.
    for key in ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
                "markov_rank", "markov_head_type"):
      assert key in config, key
    assert config["confidence_head_with_markov"] is (kind == "dspark")
  else:
    # SpecForge reads emb_dim in dflash_config, Domino's files at the top level.
    assert config["dflash_config"]["emb_dim"] == config["emb_dim"] == 10
  loaded = _written_back_exactly(source, path, target)
  _assert_same_weights(drafter, loaded)
  assert loaded.spec == drafter.spec
  features = _features(7, 6, 3)
  next_tokens = np.arange(6) + 5
  a, b = (_head_ours(d, features, next_tokens, 4) for d in (drafter, loaded))
  np.testing.assert_array_equal(a[0], b[0])
  assert a[1] == b[1]
  # A freshly built one learns its mask vector: the layouts store a mask token id.
  config = dict(variables.drafter_config_of(drafter))
  assert config.pop("mask_token_id") == drafter.spec.mask_token_id
  fresh = build_drafter(config, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(CheckpointFormatError, match="mask embedding is a learned vector"):
    drafter_io.export_drafter(fresh, tmp_path / "fresh", format="hf")


def test_head_drafter_checkpoints_we_cannot_use(target, tmp_path):
  def load(path):
    return drafter_io.load_drafter(path, target=target)

  path, _ = dspark_checkpoint(tmp_path / "a", target, target_layer_ids=[-1, 1, 2])
  with pytest.raises(CheckpointFormatError, match="input embeddings"):
    load(path)
  path, _ = dspark_checkpoint(tmp_path / "b", target, markov_head_type="gated")
  with pytest.raises(CheckpointFormatError, match="markov_head_type='gated'"):
    load(path)
  path, w = dspark_checkpoint(tmp_path / "c", target)
  w["lm_head.weight"] = w["lm_head.weight"] + 1.0  # trained against another target's head
  safetensors.torch.save_file(w, os.path.join(path, "model.safetensors"))
  with pytest.raises(DrafterMismatchError, match="'lm_head.weight' is not the target's"):
    load(path)
  path, _ = domino_checkpoint(tmp_path / "d", pure_draft_prefix_len=2)
  with pytest.raises(CheckpointFormatError, match="pure_draft_prefix_len=2"):
    load(path)
  # Without the keys SpecForge reads 0 / unshifted: not ours, and said so.
  path, _ = domino_checkpoint(tmp_path / "d2", pure_draft_prefix_len=None, shift_label=None)
  cfg = json.load(open(os.path.join(path, "config.json")))
  cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items() if v is not None}
  json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(CheckpointFormatError,
                     match="pure_draft_prefix_len=0, shift_label=False .* set them"):
    load(path)
  path, _ = dspark_checkpoint(tmp_path / "f", target, confidence_head_with_markov=True,
                              markov_rank=0)
  with pytest.raises(CheckpointFormatError, match="no Markov head"):
    load(path)
  path, w = domino_checkpoint(tmp_path / "e")
  w["prefix_gru.bias_ih_l0"] = torch.zeros(36)
  safetensors.torch.save_file(w, os.path.join(path, "model.safetensors"))
  with pytest.raises(CheckpointFormatError, match="prefix_gru.bias_ih_l0"):
    load(path)


def test_drafter_rope_and_head_options_in_our_format(target, tmp_path):
  """A drafter's own RoPE, EAGLE-3's norm_output and DSpark's confidence_head_with_markov
  survive our own format; the defaults leave the configs of before them unchanged."""
  scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=16)
  for i, config in enumerate([
      {"kind": "eagle3", "rope_theta": 10000.0, "rope_scaling": scaling, "norm_output": False},
      {"kind": "dspark", "rope_theta": 500000.0, "confidence_head_with_markov": False}]):
    drafter = build_drafter(config, target=target, rngs=nnx.Rngs(0))
    assert {k: drafter.spec.to_dict()[k] for k in config} == config
    loaded = drafter_io.load_drafter(drafter_io.export_drafter(drafter, tmp_path / str(i)),
                                     target=target)
    assert loaded.spec == drafter.spec
  plain = build_drafter({"kind": "eagle3"}, target=target, rngs=nnx.Rngs(0)).spec.to_dict()
  assert not {"rope_theta", "rope_scaling", "norm_output"} & set(plain)
  for bad, match in [({"kind": "block", "norm_output": False}, "do not apply to kind 'block'"),
                     ({"kind": "eagle3", "rope_scaling": scaling}, "rope_scaling needs rope_theta"),
                     ({"kind": "eagle3", "rope_theta": "x"}, "rope_theta must be a number")]:
    with pytest.raises(ConfigError, match=match):
      build_drafter(bad, target=target, rngs=nnx.Rngs(0))
