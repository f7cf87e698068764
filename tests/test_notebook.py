"""notebooks/quickstart.ipynb runs top to bottom (its quick variant, DLOOP_NOTEBOOK_SMOKE=1)."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.real_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # Committed without outputs: the repository holds the source, not a run.
  assert all(not c.get("outputs") and c.get("execution_count") is None
             for c in nb.cells if c.cell_type == "code")
  env = dict(os.environ, DLOOP_NOTEBOOK_SMOKE="1",
             PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
             # The kernel compiles the real model fast (conftest).
             XLA_FLAGS=os.environ["DLOOP_TEST_REAL_MODEL_XLA_FLAGS"])
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": ROOT}})
  client.execute(env=env)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
  for mode in ("ar", "sd", "dloop"):
    assert f"{mode:>5}: tau" in text, text
  assert "same tokens as ar: True" in text and "g = -8.00" in text
  assert any("image/png" in o.get("data", {}) for o in nb.cells[-2].outputs), "no plot"
