"""The tour notebook runs top to bottom on the smoke preset, as a user would run it."""

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
    # What the notebook itself reports and writes: the preset and work directory it resolved, its caches
    # and its run under that directory (nothing left in a directory of its own choosing).
    assert f"| preset smoke | work {tmp_path}\n" in outputs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["baseline-smoke", "caches"]
    assert (tmp_path / "baseline-smoke" / "metrics.jsonl").exists()
