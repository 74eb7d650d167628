"""tiered serve end to end: mlx-lm's OpenAI-compatible server started by the test on the
embedded model, a real HTTP client: two requests on one long document (the second continues
from the server's cached prefix), a streamed response, a malformed request; short requests
sent together are batched in exact caches as mlx-lm's server batches them, a long one gets a
tiered cache."""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

DOC = "The bicycle is red and it stands by the green door. " * 40


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, path, body, *, raw=None, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else json.dumps(body)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read().decode()


@pytest.fixture
def server(embedded, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tiered", "serve", "--port", str(port),
                             "--gpu-budget", "0.25", "--max-tokens", "16"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                break
        except OSError:
            time.sleep(0.5)
        assert proc.poll() is None, open(tmp_path / "server.log").read()
    yield port, tmp_path / "server.log"
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


def test_two_requests_one_document_a_stream_and_a_bad_request(server):
    port, _ = server
    ask = lambda q: {"messages": [{"role": "user", "content": DOC + "\n\n" + q}],  # noqa: E731
                     "max_tokens": 12, "temperature": 0}
    status, body = _post(port, "/v1/chat/completions", ask("What colour is the bicycle?"))
    assert status == 200, body
    first = json.loads(body)
    assert "red" in first["choices"][0]["message"]["content"].lower()
    status, body = _post(port, "/v1/chat/completions", ask("Where does the bicycle stand?"))
    assert status == 200, body
    second = json.loads(body)
    cached = second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached > 300, second["usage"]  # the document was not read again
    status, body = _post(port, "/v1/chat/completions",
                         dict(ask("What colour is the bicycle?"), stream=True))
    assert status == 200
    chunks = [json.loads(line[len("data: "):]) for line in body.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0].get("delta", {}).get("content") or "" for c in chunks)
    assert len(chunks) > 1 and "red" in text.lower()
    status, _ = _post(port, "/v1/chat/completions", None, raw="{not json")
    assert 400 <= status < 500


def test_short_requests_are_batched_exact_and_a_long_one_gets_a_tiered_cache(server):
    port, log = server
    # at --gpu-budget 0.25 the embedded model's caches compress from 71 tokens
    # (SharedContext.first_compressed_length): a short chat stays below it with 4 new tokens
    short = [{"messages": [{"role": "user", "content": q}], "max_tokens": 4, "temperature": 0}
             for q in ("Hi.", "Say yes.", "Count: 1, 2,")]
    got = [None] * len(short)

    def send(i):
        got[i] = _post(port, "/v1/chat/completions", short[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(short))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for status, body in got:
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"]
    status, body = _post(port, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": DOC + "\n\nWhat colour "
                                        "is the bicycle?"}], "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    assert "red" in json.loads(body)["choices"][0]["message"]["content"].lower()
    routes = [line for line in log.read_text().splitlines() if "tiered serve: a request" in line]
    assert len(routes) >= 4, log.read_text()[-3000:]
    assert sum("stays exact" in r and "batched" in r for r in routes) == 3, routes
    assert "a tiered cache, served alone" in routes[-1], routes
