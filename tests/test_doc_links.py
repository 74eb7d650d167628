"""Every relative link in the README, docs/ and bench/README.md points to a file that exists;
every such page stays within its length."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted({os.path.relpath(p, ROOT) for p in
                [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md"),
                 *glob.glob(os.path.join(ROOT, "docs", "*.md"))]})
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links(page: str) -> list[str]:
    text = open(os.path.join(ROOT, page)).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # not http(s):, mailto:


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    base = os.path.dirname(os.path.join(ROOT, page))
    missing = []
    for target in _links(page):
        path = target.split("#", 1)[0]
        if path and not os.path.exists(os.path.normpath(os.path.join(base, path))):
            missing.append(target)
    assert not missing, f"{page}: links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_pages_stay_readable(page):
    """A page says what is true now, not how it got there: README <= 250 lines, every other
    page <= 200 (history lives in git)."""
    limit = 250 if page == "README.md" else 200
    with open(os.path.join(ROOT, page)) as f:
        lines = sum(1 for _ in f)
    assert lines <= limit, f"{page}: {lines} lines, more than {limit}"
