"""Orbax checkpoints of training runs: contents, keep-last-k, corrupted-step fallback."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging

import trainer_hooks
from dloop_jax.training import checkpointing as ckpt_lib
from dloop_jax.training import trainer as trainer_lib


def _tree(scale: float):
  params = {"a/kernel": jnp.full((4, 8), scale), "b": jnp.arange(3.0) * scale}
  opt_state = ({"mu": {"a/kernel": jnp.zeros((4, 8)), "b": jnp.ones(3) * scale}},
               jnp.asarray(7, jnp.int32))
  return params, opt_state


def _restore(checkpointer, params, opt_state, **kw):
  return checkpointer.restore_latest(abstract_params=ckpt_lib.abstract_like(params),
                                     abstract_opt_state=ckpt_lib.abstract_like(opt_state), **kw)


def _corrupt(step_dir: str) -> None:
  """Overwrites every array data file of a step with garbage."""
  files = [f for f in glob.glob(os.path.join(step_dir, "params", "**"), recursive=True)
           if os.path.isfile(f) and os.sep + "d" + os.sep in f]
  assert files
  for f in files:
    with open(f, "wb") as fh:
      fh.write(b"\x00garbage")


def test_save_restore_keep_last_k(tmp_path):
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "ckpt", keep=2)
  for step in (1, 2, 3):
    params, opt_state = _tree(float(step))
    state = {"index": step * 10}
    checkpointer.save(step, params=params, opt_state=opt_state, model_state={},
                      data_state=state, meta={"drafter_kind": "x"})
    state["index"] = -1  # the saved state is a snapshot taken at save()
  checkpointer.wait()
  assert checkpointer.steps() == [2, 3]
  restored = _restore(checkpointer, *_tree(0.0))
  assert restored.step == 3 and restored.skipped == []
  assert restored.data_state == {"index": 30}
  assert restored.meta == {"drafter_kind": "x", "step": 3}
  np.testing.assert_array_equal(restored.params["b"], np.arange(3.0) * 3)
  assert int(restored.opt_state[1]) == 7
  checkpointer.close()


def test_close_waits_for_the_cleanup_of_killed_saves(tmp_path):
  # What a process killed mid-save leaves; orbax removes it on a thread that
  # its own close() does not wait for (the process then dies printing a
  # traceback from that thread).
  leftovers = ["5.orbax-checkpoint-tmp-1234", "6.orbax-checkpoint-tmp"]
  for name in leftovers:
    (tmp_path / name / "params").mkdir(parents=True)
    (tmp_path / name / "params" / "data").write_bytes(b"\x00" * 64)
  checkpointer = ckpt_lib.Checkpointer(tmp_path)
  checkpointer.close()
  assert not [n for n in os.listdir(tmp_path) if n in leftovers]


def test_corrupted_latest_falls_back_and_says_so(tmp_path, caplog):
  directory = tmp_path / "ckpt"
  checkpointer = ckpt_lib.Checkpointer(directory, keep=3)
  for step in (1, 2):
    params, opt_state = _tree(float(step))
    checkpointer.save(step, params=params, opt_state=opt_state, model_state={},
                      data_state={"index": step}, meta={})
  checkpointer.close()
  _corrupt(str(directory / "2"))

  checkpointer = ckpt_lib.Checkpointer(directory, keep=3)
  absl_logging.get_absl_logger().propagate = True
  with caplog.at_level("WARNING"):
    restored = _restore(checkpointer, *_tree(0.0))
  assert restored.step == 1 and restored.skipped == [2]
  assert "Checkpoint step 2" in caplog.text and "falling back to step 1" in caplog.text
  # Moved aside: a later save of step 2 does not collide with it.
  assert checkpointer.steps() == [1]
  assert [p for p in os.listdir(directory) if p.startswith("corrupt-2-")]
  params, opt_state = _tree(5.0)
  checkpointer.save(2, params=params, opt_state=opt_state, model_state={},
                    data_state={"index": 2}, meta={})
  checkpointer.wait()
  assert checkpointer.steps() == [1, 2]
  checkpointer.close()


def test_no_readable_checkpoint_is_an_error(tmp_path):
  directory = tmp_path / "ckpt"
  checkpointer = ckpt_lib.Checkpointer(directory)
  params, opt_state = _tree(1.0)
  checkpointer.save(1, params=params, opt_state=opt_state, model_state={}, data_state={},
                    meta={})
  checkpointer.close()
  _corrupt(str(directory / "1"))
  checkpointer = ckpt_lib.Checkpointer(directory)
  with pytest.raises(ckpt_lib.CheckpointError, match="No readable checkpoint"):
    _restore(checkpointer, *_tree(0.0))
  checkpointer.close()


def test_meta_check_runs_before_arrays_are_read(tmp_path):
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "ckpt")
  params, opt_state = _tree(1.0)
  checkpointer.save(1, params=params, opt_state=opt_state, model_state={}, data_state={},
                    meta={"drafter_kind": "block"})
  checkpointer.wait()

  def check(meta):
    raise ValueError(f"holds a {meta['drafter_kind']} drafter")

  # Another tree shape would fail to restore; the meta check must win (an
  # error to report, not a corruption to skip).
  with pytest.raises(ValueError, match="holds a block drafter"):
    checkpointer.restore_latest(abstract_params={"other": jax.ShapeDtypeStruct((2,), jnp.float32)},
                                abstract_opt_state=None, check_meta=check)
  assert checkpointer.steps() == [1]
  checkpointer.close()


def test_trainer_resumes_past_a_corrupted_checkpoint(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  reference = str(tmp_path / "reference")
  trainer_lib.train(trainer_hooks.tiny_config(num_steps=8), reference)
  trainer_lib.train(trainer_hooks.tiny_config(num_steps=8), workdir)
  _corrupt(os.path.join(workdir, "checkpoints", "8"))
  result = trainer_lib.train(trainer_hooks.tiny_config(num_steps=8), workdir)
  assert result.resumed_from == 4 and result.step == 8
  assert "were corrupted and moved aside; resumed from step 4" in capsys.readouterr().err
  with ckpt_lib.ocp.StandardCheckpointer() as c:
    got = c.restore(os.path.join(workdir, "checkpoints", "8", "params"))
    want = c.restore(os.path.join(reference, "checkpoints", "8", "params"))
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
