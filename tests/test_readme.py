"""The README's set-up commands are the ones CI runs."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2
    assert cmds[0].rstrip().endswith("tiered run")
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _readme_commands()[1] in ci
    assert "-eq 5" in ci  # "no tests ran" is a failure


def _tour() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    tour = text.split("## Tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)\n```", tour, flags=re.S)
    assert len(blocks) == 1, "the Tour has one Python block"
    return blocks[0]


def test_readme_tour_runs_as_written(embedded, tmp_path):
    """The Tour, extracted from the README and run as a user would (a fresh process, in an
    empty directory), reaches an answer, reports, and saves and reloads its cache."""
    import subprocess
    import sys

    script = tmp_path / "tour.py"
    script.write_text(_tour() + "\nprint('TOUR-DONE', type(cache).__name__, len(cache))\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    expected = next(x for x in lines if x.startswith("expected:")).split()[-1]
    answer = lines[0]
    assert answer.strip(), "the model answered nothing"
    assert "tiered cache:" in r.stdout and "accelerator" in r.stdout
    assert (tmp_path / "document" / "tiered.json").stat().st_size > 0
    assert lines[-1] == "TOUR-DONE TieredCacheList 30"  # the loaded cache, one per layer
    from tiered.tasks import is_correct

    assert is_correct(expected, answer), (answer, expected)
