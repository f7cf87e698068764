"""Sharded inference: a target split over a data=2, tensor=4 mesh of 8 simulated CPU devices.

Greedy outputs of ar, sd, dloop and a dloop tree on the mesh equal the
single-device ar output (which every single-device mode equals: the lossless
tests), weights load straight onto their shards, and bad meshes get clear
errors. The mesh runs in ONE subprocess: the device count is fixed when JAX
first initializes, and this process already has one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers

import model_fixtures
from dloop_jax.errors import ConfigError
from dloop_jax.models import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent(r"""
    import json, math, os, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    assert jax.device_count() == 8, jax.devices()
    import drafter_fixtures
    from dloop_jax.decoding import collectives, engine, generate
    from dloop_jax.decoding.lossless import compare
    from dloop_jax.drafters import build_drafter
    from dloop_jax.errors import ConfigError
    from dloop_jax.models import load_target, sharding
    from dloop_jax.models.transformer import Transformer, tiny_target

    COSTS = {1: 30.0, 2: 40.4, 3: 46.0, 5: 51.7, 9: 63.6, 13: 66.8, 17: 72.0, 25: 82.0}
    out = {}
    mesh = sharding.inference_mesh("data=2,tensor=4")
    one = load_target(sys.argv[1], dtype="float32").model
    split = load_target(sys.argv[1], mesh=mesh, dtype="float32").model
    layer = split.layers[0]
    out["specs"] = {n: [a for a in getattr(layer, n)[...].sharding.spec]
                    for n in ("wqkv", "wo", "w_gate_up", "w_down")}
    out["shard_shapes"] = {n: sorted({tuple(s.data.shape)
                                      for s in getattr(layer, n)[...].addressable_shards})
                           for n in ("wqkv", "wo", "w_gate_up", "w_down")}
    out["embed_shards"] = sorted({tuple(s.data.shape) for s in split.embed[...].addressable_shards})
    out["same_params"] = all(np.array_equal(v, one.flat_params()[k])
                             for k, v in split.flat_params().items())
    cache = split.init_cache(batch_size=2, capacity=8)
    out["kv_shards"] = sorted({tuple(s.data.shape) for s in cache.k[0].addressable_shards})

    fixture = drafter_fixtures.perturbed(one, noise_scale=1.0, seed=3)
    block = build_drafter({"kind": "block", "block_size": 3, "num_layers": 1}, target=one,
                          rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=int(rng.integers(1, 12))).tolist() for _ in range(4)]
    reference = generate(one, prompts, max_new_tokens=14)
    runs = {
        "ar": dict(mode="ar"),
        "sd": dict(mode="sd", drafter=fixture, block_size=3, schedule="off"),
        # The block drafter reads the split target's taps; the cost schedule
        # verifies through the lax.switch over widths.
        "dloop": dict(mode="dloop", drafter=block, block_size=3, max_stages=2, gate=-math.inf,
                      costs=COSTS),
        "dloop_tree": dict(mode="dloop", drafter=fixture, block_size=3, max_stages=2, gate=-1.0,
                           tree_budget=4),
    }
    head_dim = one.config.head_dim

    def moves(**kw):  # the program generate() just ran (compiled once, shared)
      compiled, _ = engine.decode_program(split, prompts, max_new_tokens=14, **kw)
      return collectives.head_transfers(compiled.as_text(), head_dim=head_dim)

    for name, kw in runs.items():
      got = generate(split, prompts, max_new_tokens=14, **kw)
      out[name] = dict(
          identical=[a == b for a, b in zip(reference.tokens, got.tokens)],
          lossless=[compare(one, p, a, b).lossless
                    for p, a, b in zip(prompts, reference.tokens, got.tokens)],
          accepted=got.total.accepted if kw["mode"] != "ar" else 0,
          moves=moves(**kw))
    # At a fixed width every forward after prefill is 8 tokens wide: sd and dloop
    # on the mesh reproduce ar on the mesh exactly.
    fixed = {"ar": dict(mode="ar"), "sd": runs["sd"],
             "dloop": dict(runs["dloop"], costs=None, schedule="off")}
    fixed_tokens = {}
    out["fixed"] = {}
    for name, kw in fixed.items():
      kw = dict(kw, fixed_width=8)
      got = generate(split, prompts, max_new_tokens=14, **kw)
      fixed_tokens[name] = got.tokens
      out["fixed"][name] = dict(moves=moves(**kw),
                                accepted=got.total.accepted if name != "ar" else 0)
    for name in ("sd", "dloop"):
      out["fixed"][name]["equal_ar"] = fixed_tokens[name] == fixed_tokens["ar"]

    # bf16 weights: the layers hold their matrices out-major on the mesh too.
    one16 = load_target(sys.argv[1], weights="bf16").model
    split16 = load_target(sys.argv[1], mesh=mesh, weights="bf16").model
    layer16 = split16.layers[0]
    ref16 = generate(one16, prompts, max_new_tokens=14)
    got16 = generate(split16, prompts, max_new_tokens=14, mode="sd", drafter=fixture,
                     block_size=3, schedule="off")
    out["bf16"] = dict(
        specs={n: [a for a in getattr(layer16, n)[...].sharding.spec]
               for n in ("wqkv", "wo", "w_gate_up", "w_down")},
        shard_shapes={n: sorted({tuple(s.data.shape)
                                 for s in getattr(layer16, n)[...].addressable_shards})
                      for n in ("wqkv", "wo", "w_gate_up", "w_down")},
        same_params=all(np.array_equal(v, one16.flat_params()[k])
                        for k, v in split16.flat_params().items()),
        lossless=[compare(one16, p, a, b).lossless
                  for p, a, b in zip(prompts, ref16.tokens, got16.tokens)])

    # int8 weights: the values and their per-channel scales split alike.
    one8 = load_target(sys.argv[1], weights="int8").model
    split8 = load_target(sys.argv[1], mesh=mesh, weights="int8").model
    layer8 = split8.layers[0]
    ref8 = generate(one8, prompts, max_new_tokens=14)
    got8 = generate(split8, prompts, max_new_tokens=14)
    out["int8"] = dict(
        specs={n: [[a for a in getattr(layer8, m)[...].sharding.spec] for m in (n, n + "_scale")]
               for n in ("wqkv", "wo", "w_gate_up", "w_down")},
        embed=[[a for a in m[...].sharding.spec] for m in (split8.embed, split8.embed_scale)],
        same_params=all(np.array_equal(v, one8.flat_params()[k])
                        for k, v in split8.flat_params().items()),
        lossless=[compare(one8, p, a, b).lossless
                  for p, a, b in zip(prompts, ref8.tokens, got8.tokens)])

    errors = {}
    try:
      generate(split, prompts[:3], max_new_tokens=4)
    except ConfigError as e:
      errors["batch"] = str(e)
    try:
      sharding.inference_mesh("data=2,tensor=2")
    except ConfigError as e:
      errors["devices"] = str(e)
    odd = tiny_target(seed=1, num_heads=3, num_kv_heads=3, hidden_size=30, head_dim=10,
                      intermediate_size=66)
    try:
      Transformer.from_params(odd.config, odd.flat_params(), mesh=mesh)
    except ConfigError as e:
      errors["heads"] = str(e)
    # tensor=4 does not divide 2 kv heads: attention is split on the hidden axis.
    two = tiny_target(seed=1)
    two_split = Transformer.from_params(two.config, two.flat_params(), mesh=mesh)
    tokens = np.asarray([[t % 64 for t in p[:3]] + [5] * (3 - len(p[:3]))  # vocabulary 64
                         for p in prompts[:2]], np.int32)

    def logits(model):
      graph, state = nnx.split(model)

      @jax.jit
      def forward(state, tokens):
        m = nnx.merge(graph, state)
        cache = m.init_cache(batch_size=2, capacity=8)
        return m(tokens, positions=jnp.broadcast_to(jnp.arange(3), (2, 3)), cache=cache).logits

      return np.asarray(forward(state, tokens))

    out["fallback"] = dict(
        describe=sharding.describe(two.config, two_split.layout),
        wqkv=[a for a in two_split.layers[0].wqkv[...].sharding.spec],
        kv=[a for a in sharding.kv_spec(two_split.layout)],
        logit_diff=float(np.max(np.abs(logits(two) - logits(two_split)))))
    out["errors"] = errors
    print("RESULT" + json.dumps(out))
""")


def _tiny_kv4_dir(path: str) -> str:
  """A tiny Llama with 4 kv heads (tensor=4 splits them), saved as an HF directory."""
  config = transformers.LlamaConfig(
      hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
      num_hidden_layers=1, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-5,
      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
  return model_fixtures.save_hf(model.eval(), path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  hf_dir = _tiny_kv4_dir(str(tmp_path_factory.mktemp("kv4") / "tiny"))
  env = dict(os.environ)
  # The test process's flags (LLVM opt level 0: faster compiles), plus 8 devices.
  env["XLA_FLAGS"] = (os.environ.get("DLOOP_TEST_XLA_FLAGS", "")
                      + " --xla_force_host_platform_device_count=8").strip()
  env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, hf_dir], env=env, capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("mode", ["ar", "sd", "dloop", "dloop_tree"])
def test_mesh_outputs_equal_single_device(results, mode):
  r = results[mode]
  # Split contractions sum in another order: only a near-tie may flip a token.
  assert all(r["lossless"]), r
  assert sum(r["identical"]) >= 3, r
  if mode in ("sd", "dloop_tree"):
    assert r["accepted"] > 0  # drafts were accepted on the mesh


def test_weights_and_kv_heads_are_split(results):
  assert results["same_params"]  # flat_params undoes the group-major columns
  assert results["specs"] == {"wqkv": [None, "tensor"], "wo": ["tensor", None],
                              "w_gate_up": [None, "tensor"], "w_down": ["tensor", None]}
  # D = 64, Q = 8 heads x 8, KV = 4 heads x 8, F = 96: a quarter of each per device.
  assert results["shard_shapes"] == {"wqkv": [[64, 32]], "wo": [[16, 64]],
                                     "w_gate_up": [[64, 48]], "w_down": [[24, 64]]}
  assert results["embed_shards"] == [[32, 64]]  # vocabulary 128 / 4
  # Cache [B, K, C, H] = [2, 4, 8, 8] over data x tensor: one (row, kv head) each.
  assert results["kv_shards"] == [[1, 1, 8, 8]]


@pytest.mark.parametrize("mode", ["ar", "sd", "dloop", "dloop_tree"])
def test_mesh_attention_moves_no_head_arrays(results, mode):
  # Batch 4 on data=2: two rows per data shard. Each device holds its rows' kv
  # heads of the cache and attends them itself: the optimized program holds no
  # all-gather / all-to-all / collective-permute of a cache slice, queries, keys
  # or values (a placement splitting the cache's rows x heads axis row-major
  # moved the queries and new keys / values to the cache every layer).
  assert results[mode]["moves"] == []
  if mode in results["fixed"]:
    assert results["fixed"][mode]["moves"] == []


@pytest.mark.parametrize("mode", ["sd", "dloop"])
def test_mesh_modes_equal_mesh_ar_at_fixed_width(results, mode):
  r = results["fixed"][mode]
  assert r["equal_ar"], r
  assert r["accepted"] > 0


def test_bf16_weights_are_split_out_major(results):
  b = results["bf16"]
  assert b["same_params"]
  # The transposed matrices [N, K] keep the split of the same dimension.
  assert b["specs"] == {"wqkv": ["tensor", None], "wo": [None, "tensor"],
                        "w_gate_up": ["tensor", None], "w_down": [None, "tensor"]}
  assert b["shard_shapes"] == {"wqkv": [[32, 64]], "wo": [[64, 16]],
                               "w_gate_up": [[48, 64]], "w_down": [[64, 24]]}
  assert all(b["lossless"]), b


def test_int8_weights_and_their_scales_are_split_alike(results):
  q = results["int8"]
  assert q["same_params"]
  # A scale follows its matrix's output channels: split where they are, else replicated.
  assert q["specs"] == {"wqkv": [[None, "tensor"], ["tensor"]], "wo": [["tensor", None], [None]],
                        "w_gate_up": [[None, "tensor"], ["tensor"]],
                        "w_down": [["tensor", None], [None]]}
  assert q["embed"] == [["tensor", None], ["tensor"]]
  assert all(q["lossless"]), q


def test_fallback_when_tensor_does_not_divide_kv_heads(results):
  f = results["fallback"]
  assert f["logit_diff"] < 1e-4
  assert f["wqkv"] == ["tensor", None]
  assert f["kv"] == ["data", None, None, None]
  assert "does not divide the 2 kv heads" in f["describe"]


def test_mesh_errors(results):
  e = results["errors"]
  assert "cannot be split over the mesh's data axis of size 2" in e["batch"]
  assert "needs 4 devices, JAX has 8" in e["devices"]
  assert "tensor=4 divides neither the 3 kv heads" in e["heads"]


def test_parse_mesh():
  assert sharding.parse_mesh("data=2,tensor=4") == {"data": 2, "tensor": 4}
  assert sharding.parse_mesh(" tensor=-1 ") == {"tensor": -1}
  for bad, match in [("fsdp=2", "AXIS in"), ("data=0", "positive size"), ("data=x", "positive"),
                     ("data=2,data=2", "given twice"), ("", "at least one")]:
    with pytest.raises(ConfigError, match=match):
      sharding.parse_mesh(bad)


def test_interleave_columns_round_trip():
  w = np.arange(3 * 12).reshape(3, 12)
  sizes = (4, 4, 4)  # q, k, v of 2 groups
  got = sharding.interleave_columns(w, sizes, 2)
  assert got[0].tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
  np.testing.assert_array_equal(sharding.deinterleave_columns(got, sizes, 2), w)


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "data=2"], "needs 2 devices, JAX has 1"),
    (["--mesh", "pipeline=2"], "AXIS in ['data', 'tensor']"),
    (["--dtype", "bfloat16", "--weights", "f32"], "dtype=bfloat16 with weights=f32"),
])
def test_cli_errors(argv, message, capsys):
  from infer.__main__ import main  # pylint: disable=g-import-not-at-top
  assert main(argv + ["--prompt", "hi", "--mode", "ar"]) == 2
  assert message in capsys.readouterr().err
