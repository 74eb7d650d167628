"""Misused command lines end in one line naming the fix (exit 2), never a traceback; checked
before the model loads where they can be. ``python -m tiered`` and ``--version`` work."""

import subprocess
import sys

import pytest

import tiered


def _tiered(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tiered", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("tiered run: error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def doc(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("The bicycle is red. " * 20)
    return str(p)


def test_a_missing_model_path(doc, tmp_path):
    r = _tiered("run", "--model", str(tmp_path / "no-model"), "--document", doc, "--question", "q")
    _one_line_error(r, "model not found", "embedded model")


def test_a_directory_as_document(tmp_path):
    r = _tiered("run", "--document", str(tmp_path), "--question", "q")
    _one_line_error(r, "is a directory", "one text file")


def test_a_question_without_a_document():
    r = _tiered("run", "--question", "What is the pass key?")
    _one_line_error(r, "--question needs --document")


def test_an_unwritable_save_path(doc, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the save's directory would go
    r = _tiered("run", "--document", doc, "--question", "q", "--save-cache",
                str(blocker / "save"))
    _one_line_error(r, "save directory", "choose another directory to save to")
    assert "disk_dir" not in r.stderr


@pytest.mark.parametrize("flag", ["--kv-bits", "--max-kv-size"])
def test_mlx_lm_cache_flags_are_answered(flag, doc):
    r = _tiered("run", "--document", doc, "--question", "q", flag, "4")
    _one_line_error(r, flag, "--gpu-budget")


def test_version_and_module_entry_point():
    r = _tiered("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tiered {tiered.__version__}"
    r = _tiered("info", "--json")
    assert r.returncode == 0 and '"tiered"' in r.stdout
