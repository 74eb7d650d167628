"""What an upstream test did, as one record, and the list of known failures.

known_failures.txt holds one line per (upstream file, mode, test, exception class):
``<file> <mode> <Class.test> <ExceptionClass> <reason...>``; ``#`` starts a comment. The class
name is matched exactly (``BudgetError`` is not ``ValueError``). table.py writes the file from
a run (``--known``); the integrator deletes lines as the failures go.
"""

from __future__ import annotations

from pathlib import Path

KNOWN_FAILURES = Path(__file__).with_name("known_failures.txt")
# The compressing mode by default (the list holds its failures): these tests' prompts are a
# few tokens, below which a fraction such as 0.125 keeps the cache exact (no compressed layout
# meets it there: 142 tokens on the embedded model), so the compressed path would go untested.
# An absolute budget that any layout meets, with compression from the first token on,
# compresses every layer at the first decode step.
DEFAULT_COMPRESS_BUDGET = "1GB"
DEFAULT_COMPRESS_FROM = "1"


def parse_budget(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text  # a size such as "1GB"; TieredConfig validates it


def load_known(path: Path = KNOWN_FAILURES) -> dict:
    """(file stem, mode, Class.test) -> {exception class name: reason}."""
    known: dict = {}
    if not path.exists():
        return known
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split(maxsplit=4)
        if len(fields) < 4:
            raise ValueError(f"Invalid line {number} of {path.name}: expected "
                             f"'<file> <mode> <Class.test> <Exception> <reason>', got {line!r}")
        stem, mode, test, exc = fields[:4]
        known.setdefault((stem, mode, test), {})[exc] = fields[4] if len(fields) > 4 else ""
    return known


def phase(when: str, rep, excinfo, *, root: str) -> dict:
    """What one report (setup, call, a subtest's call, teardown) says, as plain values: the
    exception itself is not kept, since its frames hold the test's model and caches."""
    entry = {"when": when, "duration": rep.duration, "skip": None, "failed": False,
             "known": hasattr(rep, "wasxfail"), "error": None, "where": None}
    if rep.skipped and not entry["known"]:
        entry["skip"] = _skip_reason(rep)
    elif rep.failed or entry["known"]:
        entry["failed"] = True
        if excinfo is not None:
            entry["error"] = excinfo.exconly().strip().splitlines()[0][:300]
            entry["where"] = _where(excinfo, root)
        else:  # a report without an exception, e.g. a known failure that no longer occurs
            entry["error"] = str(rep.longrepr).strip().splitlines()[0][:300]
    return entry


def summarize(phases, contexts) -> dict:
    """outcome / error / where of one test from its :func:`phase` entries, in order.

    ``contexts``: labels of its subtests; their reports are the first "call" entries, the
    test's own call report the last. outcome is one of passed, failed, error (setup or
    teardown), skipped, xfailed (every failure a known one)."""
    subtests = iter(contexts)
    n_calls = sum(1 for p in phases if p["when"] == "call")
    seen_calls, failures, skip = 0, [], None
    for p in phases:
        label = None
        if p["when"] == "call":
            seen_calls += 1
            if seen_calls < n_calls:
                label = next(subtests, None)
        skip = skip or p["skip"]
        if p["failed"]:
            failures.append({"phase": p["when"], "subtest": label, "error": p["error"],
                             "where": p["where"], "known": p["known"]})
    if skip is not None and not failures:
        return {"outcome": "skipped", "error": skip, "where": None, "failures": []}
    if not failures:
        return {"outcome": "passed", "error": None, "where": None, "failures": []}
    if all(f["known"] for f in failures):
        outcome = "xfailed"
    elif any(f["phase"] != "call" and not f["known"] for f in failures):
        outcome = "error"
    else:
        outcome = "failed"
    first = next(f for f in failures if not f["known"]) if outcome != "xfailed" else failures[0]
    return {"outcome": outcome, "error": first["error"], "where": first["where"],
            "failures": failures}


def _skip_reason(rep) -> str:
    longrepr = rep.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[:300]


def _where(excinfo, root: str):
    """The upstream test line that failed, and the deepest frame outside unittest (where the
    error arose)."""
    entries = [e for e in excinfo.traceback if "/unittest/" not in str(e.path)]
    if not entries:
        return None
    in_test = [e for e in entries if str(e.path).startswith(root)]

    def short(entry):
        return f"{'/'.join(str(entry.path).split('/')[-2:])}:{entry.lineno + 1}"

    parts = []
    if in_test:
        statement = str(in_test[-1].statement).strip().splitlines()[0]
        parts.append(f"{short(in_test[-1])} `{statement}`")
    if not in_test or entries[-1] is not in_test[-1]:
        parts.append(f"raised at {short(entries[-1])}")
    return "; ".join(parts)
