"""Data-scaling curves (`dloop_jax.training.scaling_curve`, `python -m train.scaling`)."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from dloop_jax.errors import ConfigError
from dloop_jax.training import checkpointing
from dloop_jax.training import scaling_curve as sc
from train import scaling as scaling_cli


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_alpha_and_tau_invert_each_other(gamma):
  for alpha in np.linspace(0.01, 0.99, 23):
    tau = float(sc.tau_of_alpha(alpha, gamma))
    assert 1 < tau < gamma + 1
    assert sc.alpha_of_tau(tau, gamma) == pytest.approx(alpha, abs=1e-9)
  # gamma drafts, each accepted with probability 1/2: 1 + 1/2 + ... + 1/2^gamma.
  assert float(sc.tau_of_alpha(0.5, gamma)) == pytest.approx(2 - 0.5 ** gamma)
  for tau in (1.0, gamma + 1.0, 0.5):
    with pytest.raises(ConfigError, match="outside"):
      sc.alpha_of_tau(tau, gamma)


def test_fit_recovers_a_logit_linear_law_and_inverts_its_prediction():
  truth = sc.ScalingFit(intercept=-2.5, slope=0.4, gamma=4)
  points = [(n, float(truth.predict(n))) for n in (1_000, 3_000, 10_000, 30_000)]
  got = sc.fit(points, gamma=4)
  assert got.intercept == pytest.approx(-2.5, abs=1e-9)
  assert got.slope == pytest.approx(0.4, abs=1e-9)
  assert float(got.predict(100_000)) == pytest.approx(float(truth.predict(100_000)))
  assert got.examples_for_tau(2.0) == pytest.approx(
      10 ** ((math.log(sc.alpha_of_tau(2.0, 4) / (1 - sc.alpha_of_tau(2.0, 4))) + 2.5) / 0.4))
  assert float(got.predict(got.examples_for_tau(2.0))) == pytest.approx(2.0)
  # Predictions stay inside (1, gamma + 1) however far they reach.
  assert 1 < float(got.predict(1)) and float(got.predict(1e30)) < 5
  # A curve that falls with data never reaches a higher tau.
  falling = sc.fit([(1_000, 1.5), (10_000, 1.4)], gamma=4)
  assert falling.slope < 0 and falling.examples_for_tau(2.0) == math.inf
  with pytest.raises(ConfigError, match="two data sizes"):
    sc.fit([(1_000, 1.3), (1_000, 1.4)], gamma=4)


def _write_run(workdir, *, taus_by_step, max_examples, block_size=4, num_steps=None,
               patience=0, partial_last_line=False):
  """A workdir as `python -m train` leaves it: metrics.jsonl and a checkpoint's metadata."""
  workdir.mkdir(parents=True)
  last = max(taus_by_step)
  lines = []
  for step in range(10, last + 1, 10):
    lines.append(json.dumps(dict(step=step, loss=5.0 - step / 1000)))
    if step in taus_by_step:
      lines.append(json.dumps(dict(step=step, engine_tau_sd=taus_by_step[step],
                                   engine_tau_dloop=taus_by_step[step])))
  if partial_last_line:
    lines.append('{"step": ')
  (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  ckpt = checkpointing.Checkpointer(workdir / "checkpoints", async_save=False)
  ckpt.save(last, params={"w": jnp.zeros((2,))}, opt_state={"m": jnp.zeros((2,))}, model_state={},
            data_state={"next": 0},
            meta=dict(drafter_config=dict(kind="block", block_size=block_size),
                      config=dict(num_steps=num_steps or last, eval=dict(patience=patience),
                                  data=dict(max_examples=max_examples, path="/nonexistent"))))
  ckpt.close()


def test_read_run_takes_the_examples_and_gamma_from_the_checkpoint(tmp_path):
  _write_run(tmp_path / "r", taus_by_step={100: 1.2, 200: 1.35, 300: 1.3, 400: 1.35},
             max_examples=3_000, num_steps=2_400, partial_last_line=True)
  run = sc.read_run(str(tmp_path / "r"))
  assert (run.examples, run.gamma, run.num_steps, run.last_step) == (3_000, 4, 2_400, 400)
  assert run.steps == (100, 200, 300, 400) and run.taus == (1.2, 1.35, 1.3, 1.35)
  # The first of equal values is the best (the trainer keeps the first best step).
  assert (run.best_step, run.best_tau, run.converged) == (200, 1.35, True)
  # Stopped at step 400 of 2,400 with no patience: its best may still rise.
  assert (run.finished, run.lower_bound, run.status()) == (
      False, True, "stopped at step 400 of 2,400")
  assert sc.read_run(str(tmp_path / "r"), examples=7).examples == 7

  _write_run(tmp_path / "rising", taus_by_step={100: 1.1, 200: 1.2}, max_examples=1_000)
  # A run still training: reading it leaves the temporary directory of its save in flight.
  in_flight = tmp_path / "rising" / "checkpoints" / "300.orbax-checkpoint-tmp"
  (in_flight / "params").mkdir(parents=True)
  assert not sc.read_run(str(tmp_path / "rising")).converged
  assert (in_flight / "params").is_dir()


def test_a_run_is_finished_by_its_steps_or_its_patience(tmp_path):
  taus = {100: 1.2, 200: 1.35, 300: 1.3, 400: 1.33}
  for name, num_steps, patience, status in (("all_steps", 400, 0, "converged"),
                                            ("patience", 2_400, 2, "converged"),
                                            ("stopped", 2_400, 3, "stopped at step 400 of 2,400")):
    _write_run(tmp_path / name, taus_by_step=taus, max_examples=1_000, num_steps=num_steps,
               patience=patience)
    run = sc.read_run(str(tmp_path / name))
    assert (run.patience, run.status(), run.lower_bound) == (
        patience, status, status != "converged")
    assert sc.RunCurve.from_json(json.loads(json.dumps(run.to_json()))) == run


def test_read_run_errors_name_what_is_wrong(tmp_path):
  with pytest.raises(ConfigError, match="no metrics.jsonl"):
    sc.read_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 1}\n')
  with pytest.raises(ConfigError, match="measured no engine"):
    sc.read_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 10, "engine_tau_sd": 1.2}\n')
  with pytest.raises(ConfigError, match="no checkpoints.*--examples"):
    sc.read_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1\n{"step": 10, "engine_tau_sd": 1.2}\n')
  with pytest.raises(ConfigError, match="line 1, is not JSON"):
    sc.read_run(str(tmp_path))


def test_command_prints_the_table_and_fit_and_writes_plot_and_json(tmp_path, capsys):
  runs = []
  for n, taus in ((1_000, {200: 1.2, 400: 1.25, 600: 1.22}), (3_000, {200: 1.2, 400: 1.3}),
                  (10_000, {200: 1.2, 400: 1.35, 600: 1.4})):
    _write_run(tmp_path / f"block_{n}", taus_by_step=taus, max_examples=n)
    runs.append(str(tmp_path / f"block_{n}"))
  out, out_json = tmp_path / "curve.png", tmp_path / "curve.json"
  assert scaling_cli.main(["--runs", ",".join(runs), "--out", str(out), "--json",
                           str(out_json), "--extrapolate", "100000"]) == 0
  text = capsys.readouterr().out
  assert "| 1,000 | block_1000 | 400 (600) | 1.250 | converged |" in text
  assert "| 10,000 | block_10000 | 600 (600) | 1.400 | still rising |" in text
  assert "block_3000: τ was still rising" in text
  assert "| examples | 200 | 400 | 600 |" in text
  assert "| 3,000 | 1.200 | 1.300 |  |" in text
  assert "extrapolation, not a measurement" in text
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  result = json.loads(out_json.read_text())
  assert [p[1] for p in result["points"]] == [1.25, 1.3, 1.4]
  expected = sc.fit([(1_000, 1.25), (3_000, 1.3), (10_000, 1.4)], gamma=4)
  assert result["fit"]["slope"] == pytest.approx(expected.slope)
  assert result["extrapolation"]["100000"] == pytest.approx(float(expected.predict(100_000)))

  # --held-out: the points become train.evaluate's tau of each run's best step.
  held_out = tmp_path / "held_out.json"
  held_out.write_text(json.dumps(dict(rows=[
      dict(drafter=f"{r}/best", heads_off="", engine_tau_sd=t)
      for r, t in zip(runs, (1.21, 1.24, 1.33))])))
  assert scaling_cli.main(["--runs", ",".join(runs), "--held-out", str(held_out), "--json",
                           str(out_json)]) == 0
  assert [p[1] for p in json.loads(out_json.read_text())["points"]] == [1.21, 1.24, 1.33]
  capsys.readouterr()
  assert scaling_cli.main(["--runs", runs[0] + "," + str(tmp_path / "elsewhere"),
                           "--held-out", str(held_out)]) == 2
  assert "no metrics.jsonl" in capsys.readouterr().err


def test_archived_curves_replace_runs_whose_workdirs_are_gone(tmp_path, capsys):
  runs = []
  for n, taus in ((1_000, {200: 1.2, 400: 1.25, 600: 1.22}), (3_000, {200: 1.2, 400: 1.3, 500: 1.28}),
                  (10_000, {200: 1.2, 400: 1.35, 600: 1.4})):
    _write_run(tmp_path / f"block_{n}", taus_by_step=taus, max_examples=n, num_steps=600)
    runs.append(str(tmp_path / f"block_{n}"))
  held_out = tmp_path / "held_out.json"
  held_out.write_text(json.dumps(dict(rows=[
      dict(drafter=f"{r}/best", heads_off="", engine_tau_sd=t)
      for r, t in zip(runs, (1.21, 1.24, 1.33))])))
  first, archive = tmp_path / "all.json", tmp_path / "two.json"
  assert scaling_cli.main(["--runs", ",".join(runs), "--held-out", str(held_out),
                           "--json", str(first)]) == 0
  assert scaling_cli.main(["--runs", ",".join(runs[:2]), "--held-out", str(held_out),
                           "--json", str(archive)]) == 0
  text = capsys.readouterr().out
  assert "block_3000: the run stopped at step 500 of 600" in text
  # The first two runs only from their archive, the third from its workdir: the same curve.
  again = tmp_path / "again.json"
  assert scaling_cli.main(["--curves", str(archive), "--runs", runs[2], "--held-out",
                           str(held_out), "--json", str(again)]) == 0
  text = capsys.readouterr().out
  assert "| 3,000 | block_3000 | 400 (500) | 1.300 | stopped at step 500 of 600 | 1.240 |" in text
  want, got = json.loads(first.read_text()), json.loads(again.read_text())
  assert sorted(map(tuple, got["points"])) == sorted(map(tuple, want["points"]))
  assert got["fit"] == pytest.approx(want["fit"])
  # The points of one curve come from one kind of measurement.
  assert scaling_cli.main(["--curves", str(archive), "--runs", runs[2]]) == 2
  assert "mix" in capsys.readouterr().err
  (tmp_path / "bad.json").write_text(json.dumps(dict(runs=[dict(workdir="x", examples=1)])))
  assert scaling_cli.main(["--curves", str(tmp_path / "bad.json")]) == 2
  assert "lacks" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    scaling_cli.main(["--curves", str(archive), "--held-out", str(held_out)])


def test_command_refuses_runs_of_different_block_sizes(tmp_path, capsys):
  _write_run(tmp_path / "a", taus_by_step={100: 1.2}, max_examples=1_000, block_size=4)
  _write_run(tmp_path / "b", taus_by_step={100: 1.2}, max_examples=3_000, block_size=8)
  assert scaling_cli.main(["--runs", f"{tmp_path / 'a'},{tmp_path / 'b'}"]) == 2
  assert "different block sizes [4, 8]" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    scaling_cli.main(["--runs", f"{tmp_path / 'a'}", "--examples", "1,2"])
