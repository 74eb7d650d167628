"""Kernel source text without comments or blank lines, as handed to MLX on CUDA.

MLX CUDA's ``CustomKernel::eval_gpu`` hashes the kernel's whole source at every launch to find
its compiled module (``std::hash<std::string>`` of header + body). The shared headers are
mostly comments: the tau selection's persistent kernel was 42 KB of text, and hashing took a
fifth of a custom kernel's dispatch on an H200 (py-spy, 11 launches per layer). Only comments
and whitespace go: the token stream the compiler sees is the same (tests/test_compact.py).
"""

from __future__ import annotations


def compact(text: str) -> str:
    """``text`` (CUDA C++) with ``//`` and ``/* */`` comments removed, each line stripped and
    empty lines dropped; string and character literals are kept as they are, and a line
    continued by a backslash keeps the line after it (even when that one becomes empty)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":  # a literal, copied whole (escapes included)
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError("unterminated /* comment in kernel source")
            out.append(" ")
            i = j + 2
        else:
            out.append(c)
            i += 1
    lines, continued = [], False
    for line in "".join(out).split("\n"):
        line = line.strip()
        if line or continued:
            lines.append(line)
        continued = line.endswith("\\")
    return "\n".join(lines) + "\n"
