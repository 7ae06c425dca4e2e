"""The tour notebook runs top to bottom on the smoke preset, as a user would run it."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tour_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_NOTEBOOK_DIR", str(tmp_path))
    monkeypatch.setenv("DSPARK_NOTEBOOK_PRESET", "smoke")
    notebook = nbformat.read(ROOT / "notebooks" / "dspark_jax_tour.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = "".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "the target accepted" in outputs and "identical to target greedy: 2/2" in outputs
    assert (tmp_path / "baseline-smoke" / "metrics.jsonl").exists()
    assert os.environ["DSPARK_NOTEBOOK_DIR"] == str(tmp_path)
