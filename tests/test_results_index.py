"""`results/README.md` indexes every results folder, each with a README, a commit and a status."""

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROW = re.compile(r"^\| `([^`/]+)/` \| (\d{4}-\d{2}-\d{2}) \| [^|]+ \| ([0-9a-f]{7,}) \| (.+) \|$")


def _rows() -> dict[str, str]:
    lines = (RESULTS / "README.md").read_text().splitlines()
    rows = [ROW.match(line) for line in lines if line.startswith("| `")]
    assert all(rows), [line for line, row in zip(lines, rows) if not row]
    return {row[1]: row[4] for row in rows}


def test_every_results_folder_has_a_readme_and_one_index_row():
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    rows = _rows()
    assert sorted(rows) == folders, set(folders) ^ set(rows)
    assert [f for f in folders if not (RESULTS / f / "README.md").exists()] == []


def test_each_status_is_current_or_names_an_existing_successor():
    for folder, status in _rows().items():
        assert status.startswith(("current", "superseded by `")), (folder, status)
        for successor in re.findall(r"superseded by `([^`/]+)/`", status):
            assert (RESULTS / successor).is_dir() and successor != folder, (folder, successor)
