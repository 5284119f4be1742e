"""experiments/reproduce.py: every run.py command it would run passes the command line's own
checks (a key Hydra's sweeper takes but run.py refuses once cost a whole quick run two of its
figures), and the manifest keeps one row per figure, the latest."""

from __future__ import annotations

import csv
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from xengine.commandline import prepare_argv

ROOT = Path(__file__).resolve().parents[1]


def _reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "experiments/reproduce.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_every_run_command_passes_the_command_line_checks(quick):
    mod = _reproduce()
    out = Path("results/quick") if quick else Path("results")
    checked = 0
    for step in mod.steps(out, quick):
        for command in (step.quick if quick else step.full) or ():
            for part in command.split(" && "):
                argv = shlex.split(part)
                if argv[:2] == ["python", "run.py"]:
                    prepare_argv(argv[2:], ROOT / "conf")  # raises ConfigError
                    checked += 1
    assert checked >= 5  # every step with a sweep


def test_the_manifest_keeps_the_latest_row_of_each_figure(tmp_path):
    mod = _reproduce()
    path = tmp_path / "reproduce_manifest.csv"
    first = mod.Manifest(path)
    first.add("a.png", "python one", "abc", 10.4)
    first.add("b.png", "python two", "abc", 3.0)
    again = mod.Manifest(path)  # a later run of one step (--only)
    again.add("a.png", "python one --quick", "def", 12.0)
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["figure"], r["commit"], r["step_s"]) for r in rows] == [
        ("a.png", "def", "12"),
        ("b.png", "abc", "3"),
    ]


def test_every_figure_the_documents_show_is_made_by_a_step():
    mod = _reproduce()
    made = {f"results/{f}" for step in mod.steps(Path("results"), False) for f in step.figures}
    shown = set()
    for doc in ("README.md", "docs/measurements.md"):
        shown |= set(re.findall(r"results/[\w/.-]+\.png", (ROOT / doc).read_text()))
    assert shown, "no figure found in the documents"
    assert not shown - made, sorted(shown - made)


def test_every_python_that_starts_a_program_is_this_interpreter():
    mod = _reproduce()
    cmd = "taskset -c 0 python a.py --x python & a=$!; python b.py && python c.py"
    exe = mod.shlex.quote(sys.executable)
    assert mod.with_interpreter(cmd) == (
        f"taskset -c 0 {exe} a.py --x python & a=$!; {exe} b.py && {exe} c.py"
    )


def test_the_scripts_csv_writer_keeps_every_column_and_refuses_stray_ones(tmp_path):
    """experiments/common.py: the writer every benchmark script uses. Rows of one file may
    differ (a failed net has no measurements): every key becomes a column in the order it
    first appears, a missing key or None is an empty cell; with fixed columns a stray key is
    an error unless the caller says to drop it."""
    from experiments.common import write_csv

    rows = [{"net": "a", "ms": 1.5}, {"net": "b", "error": "boom", "ms": None}]
    path = write_csv(tmp_path / "new" / "out.csv", rows)  # the folder is made
    with path.open(newline="") as fh:
        got = list(csv.reader(fh))
    assert got == [["net", "ms", "error"], ["a", "1.5", ""], ["b", "", "boom"]]

    with pytest.raises(ValueError, match="error"):
        write_csv(tmp_path / "fixed.csv", rows, ["net", "ms"])
    write_csv(tmp_path / "fixed.csv", rows, ["net", "ms"], only=True)
    assert (tmp_path / "fixed.csv").read_text().splitlines() == ["net,ms", "a,1.5", "b,"]
