"""Markdown tables from the records the upstream harness writes (TIERED_UPSTREAM_RESULTS).

    python -m tests.mlxlm_upstream.table RESULTS.jsonl [MORE.jsonl ...] [--known PATH]

Prints, per upstream file and mode, the counts; the tests that pass with mlx-lm's own caches
and fail in a tiered mode; every failure with its error's first line and where it arose; and
every test whose compared values differ from its reference, with the largest difference.
``--known PATH`` also writes the failures of the run as a known-failures list (see
record.py); run it on a run made with TIERED_UPSTREAM_KNOWN=0.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from .record import DEFAULT_COMPRESS_BUDGET, DEFAULT_COMPRESS_FROM, parse_budget

MODE_ORDER = {"baseline": 0, "exact": 1, "compress": 2}
COUNTED = ("passed", "failed", "error", "skipped", "xfailed")


def read(paths) -> list[dict]:
    records = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                # Compressing runs with other settings are separate columns of the tables.
                r["label"] = r["mode"] if r["mode"] != "compress" else _setting(r)
                records[(r["file"], r["label"], r["test"])] = r  # a later run of a test wins
    return sorted(records.values(), key=lambda r: (r["file"], MODE_ORDER.get(r["mode"], 9),
                                                   r["label"], r["test"]))


def _setting(r) -> str:
    options = "".join(f", {k}={v}" for k, v in (r.get("options") or {}).items())
    return f"compress {r['budget']}{options}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ") if text is not None else ""


def _signature(error) -> str:
    """An error's first line with numbers and object addresses blanked, for grouping."""
    text = re.sub(r" at 0x[0-9a-f]+", "", str(error))
    return re.sub(r"\d+(\.\d+)?", "N", text)[:160]


def _failure_rows(r):
    """One row per failure of a test: the test's own and each failing subtest."""
    failures = r.get("failures") or [{"subtest": None, "error": r["error"], "where": r["where"]}]
    for f in failures:
        name = r["test"] + (f" [{f['subtest']}]" if f.get("subtest") else "")
        yield name, f["error"], f["where"]


def render(records) -> str:
    out = []
    by_key = defaultdict(list)
    for r in records:
        by_key[(r["file"], r["label"])].append(r)
    baseline = {(r["file"], r["test"]): r["outcome"] for r in records if r["mode"] == "baseline"}
    tiered_labels = list(dict.fromkeys(r["label"] for r in records if r["mode"] != "baseline"))

    out += ["| upstream file | mode | tests | passed | failed | errored | skipped | "
            "known (xfailed) | built a TieredCache | ended compressed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for (stem, mode), rs in by_key.items():
        n = {k: sum(r["outcome"] == k for r in rs) for k in COUNTED}
        tiered = rs[0]["budget"] is not None
        built = sum((r.get("tiered_layers") or 0) > 0 for r in rs) if tiered else "-"
        squeezed = sum((r.get("compressed_layers") or 0) > 0 for r in rs) if tiered else "-"
        out.append(f"| {stem}.py | {mode} | {len(rs)} | {n['passed']} | {n['failed']} "
                   f"| {n['error']} | {n['skipped']} | {n['xfailed']} | {built} | {squeezed} |")

    bad = ("failed", "error", "xfailed")
    out += ["", "### Pass with mlx-lm's own caches, fail in a tiered mode, by error", "",
            "Errors with their numbers and addresses blanked (N); a test with subtests counts "
            "once per distinct error.", "",
            "| error | " + " | ".join(tiered_labels) + " |",
            "|---|" + "---|" * len(tiered_labels)]
    groups = defaultdict(lambda: defaultdict(list))
    for r in records:
        if (r["label"] in tiered_labels and r["outcome"] in bad
                and baseline.get((r["file"], r["test"])) == "passed"):
            for sig in dict.fromkeys(_signature(e) for _, e, _ in _failure_rows(r)):
                groups[sig][r["label"]].append(f"{r['file']}::{r['test'].split('.', 1)[1]}")
    for sig, modes in sorted(groups.items(), key=lambda g: -sum(map(len, g[1].values()))):
        cells = [f"{len(modes[m])}: " + ", ".join(f"`{t}`" for t in modes[m]) if modes[m] else ""
                 for m in tiered_labels]
        out.append(f"| {_cell(sig)} | " + " | ".join(cells) + " |")

    out += ["", "### Failures", "",
            "Error: first line of the exception; where: the upstream test line, then the "
            "deepest frame outside unittest. Max |a-b|: the largest difference among the "
            "test's `mx.allclose` / `mx.array_equal` comparisons that came out False.", ""]
    for (stem, mode), rs in by_key.items():
        failing = [r for r in rs if r["outcome"] in bad]
        if not failing:
            continue
        out += [f"#### {stem}.py, {mode} ({len(failing)})", "",
                "| test | with mlx-lm's caches | error | where | max \\|a-b\\| |",
                "|---|---|---|---|---|"]
        for r in failing:
            base = "" if r["mode"] == "baseline" else baseline.get((stem, r["test"]), "not run")
            for name, error, where in _failure_rows(r):
                diff = r["max_abs_diff_failed"]
                out.append(f"| {_cell(name)} | {base} | {_cell(error)} | {_cell(where)} | "
                           f"{'' if diff is None else f'{diff:.3g}'} |")
        out.append("")

    out += ["### Compared values that differ from their reference", "",
            "Every test whose `mx.allclose` / `mx.array_equal` arguments differed anywhere "
            "(passing or not): the largest |a-b| over all its comparisons.", "",
            "| upstream file | mode | test | outcome | comparisons | max \\|a-b\\| |",
            "|---|---|---|---|---|---|"]
    for r in records:
        if r["max_abs_diff"]:
            out.append(f"| {r['file']}.py | {r['label']} | {r['test']} | {r['outcome']} | "
                       f"{r['comparisons']} | {r['max_abs_diff']:.3g} |")

    skipped = [r for r in records if r["outcome"] == "skipped"]
    if skipped:
        out += ["", "### Skipped", "", "| upstream file | mode | test | reason |",
                "|---|---|---|---|"]
        out += [f"| {r['file']}.py | {r['label']} | {r['test']} | {_cell(r['error'])} |"
                for r in skipped]
    return "\n".join(out) + "\n"


def known_lines(records, default_label) -> str:
    lines = []
    for r in records:
        if r["outcome"] not in ("failed", "error", "xfailed"):
            continue
        if r["mode"] == "compress" and r["label"] != default_label:
            continue  # the list holds the default compressing settings only
        seen = set()
        for f in r.get("failures") or []:
            exc = f["error"].split(":", 1)[0].rsplit(".", 1)[-1]
            if exc in seen:
                continue
            seen.add(exc)
            reason = f["error"].split(":", 1)[1] if ":" in f["error"] else ""
            reason = re.sub(r" at 0x[0-9a-f]+", "", reason).strip().replace("#", "")
            lines.append(f"{r['file']} {r['mode']} {r['test']} {exc} {reason[:120]}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--known", help="also write the run's failures as a known-failures list")
    args = parser.parse_args(argv)
    records = read(args.results)
    print(render(records), end="")
    if args.known:
        with open(args.known, "w") as f:
            f.write("# Written by tests/mlxlm_upstream/table.py from a TIERED_UPSTREAM_KNOWN=0 "
                    "run; format in record.py.\n"
                    + known_lines(records, _setting({
                        "budget": parse_budget(DEFAULT_COMPRESS_BUDGET),
                        "options": {"compress_from": int(DEFAULT_COMPRESS_FROM)}})))


if __name__ == "__main__":
    main()
