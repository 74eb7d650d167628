"""The README's set-up commands are the ones CI runs; its other blocks run as written."""

import os
import re

import pytest

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
    from tiered.planning.tasks import is_correct

    assert is_correct(expected, answer), (answer, expected)


LETTER = ("Dear Thomas,\n\nThe harbour was quiet this morning and the boats stayed in. I found "
          "your old compass in the drawer by the window and I am sending it back with this "
          "letter. The garden is full of beans again.\n\nWith love,\nMargaret Hale\n")


def _block(section: str, lang: str) -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    body = text.split(f"\n{section}\n", 1)[1]
    return re.findall(rf"```{lang}\n(.*?)\n```", body, flags=re.S)[0]


@pytest.mark.slow  # ~60 s; each line's command has its own test in CI: test_foundation's
# test_cli_document_run, test_cli_mlx (cache-prompt, generate), test_serve
def test_readme_command_line_and_openai_client_run_as_written(embedded, tmp_path):
    """The Tour's command-line block, line by line as a user types it, on a book.txt made
    here; its `tiered serve` line then answers the Serving section's OpenAI client (the
    ``openai`` package, as the README says to install it: skipped there without it)."""
    import http.client
    import subprocess
    import sys
    import time

    (tmp_path / "book.txt").write_text(LETTER)
    lines = [ln.split("  #")[0].strip() for ln in _block("Command line:", "bash").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    serve = [ln for ln in lines if ln.startswith("tiered serve")]
    assert len(serve) == 1 and len(lines) == 5
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONUNBUFFERED="1")
    for line in lines:
        if line in serve:
            continue
        r = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                           timeout=900, env=env)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        if "--question" in line:  # tiered run asks the question after the letter
            assert "Margaret" in r.stdout or "Hale" in r.stdout, (line, r.stdout)
        if line.startswith("tiered generate"):  # mlx-lm's generate output, from the cache
            assert "Generation:" in r.stdout and len(r.stdout.split("==========")[1].strip())
    assert (tmp_path / "book.safetensors").exists()
    with socket_free(8080):
        log = open(tmp_path / "serve.log", "w+")
        proc = subprocess.Popen(["bash", "-c", "exec " + serve[0]], cwd=tmp_path, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while True:
                assert proc.poll() is None, open(tmp_path / "serve.log").read()[-2000:]
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", 8080, timeout=5)
                    conn.request("GET", "/v1/models")
                    if conn.getresponse().status == 200:
                        break
                except OSError:
                    assert time.time() < deadline, "tiered serve did not come up"
                    time.sleep(0.5)
            pytest.importorskip("openai")  # the test extra installs it (pyproject.toml)
            client = tmp_path / "client.py"
            client.write_text(_block("## Serving", "python"))
            r = subprocess.run([sys.executable, str(client)], cwd=tmp_path, capture_output=True,
                               text=True, timeout=900, env=env)
            assert r.returncode == 0, r.stderr[-2000:]
            assert r.stdout.strip(), "the server answered nothing"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()


class socket_free:
    """Skip (not fail) when something else already listens on the README's port."""

    def __init__(self, port: int):
        self.port = port

    def __enter__(self):
        import socket

        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", self.port)) == 0:
                pytest.skip(f"port {self.port} is in use here; the README's command uses it")
        return self

    def __exit__(self, *exc):
        return False
