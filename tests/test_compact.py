"""metal/compact.py: kernel sources handed to MLX CUDA lose only comments and whitespace."""

import shutil
import subprocess

import pytest

from tiered.metal.compact import compact

from test_metal_syntax import _plans


def _tokens(text: str) -> list[str]:
    """The token stream after the preprocessor's comment removal (no macro expansion)."""
    run = subprocess.run(["cpp", "-fpreprocessed", "-P", "-w", "-"], input=text,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


@pytest.mark.skipif(shutil.which("cpp") is None, reason="cpp not installed")
def test_every_cuda_source_keeps_its_tokens():
    seen = set()
    for _, spec, _ in _plans("cuda"):
        if spec.name in seen:
            continue
        seen.add(spec.name)
        backend_header, backend_source = spec.sources("cuda")
        raw_header, raw_source = spec.sources("cuda", raw=True)
        assert _tokens(backend_header) == _tokens(raw_header), spec.name
        assert _tokens(backend_source) == _tokens(raw_source), spec.name
        assert len(backend_header) + len(backend_source) < len(raw_header) + len(raw_source)
    assert len(seen) >= 5


def test_literals_and_continuations_survive():
    text = ('#define A(x) x + \\\n  // gone\n  1\n'
            'const char* s = "a // not a comment"; /* gone */ char c = \'/\';  // gone\n\n'
            'int y = 2 /* inline */ * 3;\n')
    got = compact(text)
    assert got == ('#define A(x) x + \\\n\n1\n'
                   'const char* s = "a // not a comment";   char c = \'/\';\n'
                   'int y = 2   * 3;\n')
    assert "gone" not in got


def test_unterminated_block_comment_is_refused():
    with pytest.raises(ValueError, match="unterminated"):
        compact("int x; /* no end")
