"""tiered cache-prompt and tiered generate: mlx-lm's commands and flags with a tiered cache, on
the embedded model (a document read once, saved, asked again from the saved file)."""

import subprocess
import sys

import pytest

DOC = "The bicycle is red and it stands by the green door. " * 60


def _tiered(*args, stdin=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "tiered", *args], input=stdin,
                          capture_output=True, text=True, timeout=900, cwd=cwd)


@pytest.mark.usefixtures("embedded")
@pytest.mark.parametrize("name", ["doc.safetensors",
                                  pytest.param("docdir", marks=pytest.mark.slow)])
def test_cache_prompt_then_generate_from_the_saved_cache(tmp_path, name):
    save = str(tmp_path / name)
    r = _tiered("cache-prompt", "--prompt", "-", "--prompt-cache-file", save, stdin=DOC)
    assert r.returncode == 0, r.stderr
    assert "saved" in r.stderr
    r = _tiered("generate", "--prompt-cache-file", save, "--prompt",
                "What colour is the bicycle?", "--max-tokens", "10", "--verbose", "False")
    assert r.returncode == 0, r.stderr
    assert "red" in r.stdout.lower(), r.stdout


@pytest.mark.usefixtures("embedded")
def test_generate_reads_the_prompt_from_stdin_with_mlx_lm_flags():
    r = _tiered("generate", "--prompt", "-", "--max-tokens", "12", "--temp", "0",
                "--system-prompt", "Answer with one word.", "--verbose", "False",
                stdin=DOC + "\n\nWhat colour is the bicycle?")
    assert r.returncode == 0, r.stderr
    assert "red" in r.stdout.lower(), r.stdout


@pytest.mark.parametrize("cmd", ["generate", "cache-prompt"])
@pytest.mark.parametrize("flag", ["--kv-bits", "--max-kv-size"])
def test_mlx_lm_cache_flags_are_answered(cmd, flag, tmp_path):
    extra = ["--prompt-cache-file", str(tmp_path / "x.safetensors")] if cmd == "cache-prompt" \
        else []
    r = _tiered(cmd, "--prompt", "hi", flag, "4", *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"tiered {cmd}: error: {flag}" in r.stderr and "--gpu-budget" in r.stderr


def test_a_missing_saved_cache_is_one_line(tmp_path):
    r = _tiered("generate", "--prompt-cache-file", str(tmp_path / "none.safetensors"),
                "--prompt", "q")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no saved cache" in r.stderr
