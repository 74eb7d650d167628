"""The key-value and planted-facts tasks: one right answer, in the prompt, within the length."""

from __future__ import annotations

import re

import pytest

from tiered.planning.tasks_retrieval import kv_retrieval, planted_facts


@pytest.mark.parametrize("make", [kv_retrieval, planted_facts])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_one_answer_in_the_document(embedded, make, seed):
    _, tok = embedded
    s = make(tok, 1500, seed=seed)
    assert s.n_tokens <= 1500 and s.n_tokens > 1200
    assert len(tok.encode(s.prompt)) == s.n_tokens
    assert s.prompt.endswith(s.question)
    assert s.document.count(s.answer) == 1  # planted once, never in the question
    assert s.answer not in s.question
    again = make(tok, 1500, seed=seed)
    assert again.prompt == s.prompt  # deterministic per seed


def test_kv_lines_look_alike(embedded):
    _, tok = embedded
    s = kv_retrieval(tok, 1500, seed=3, keys=6)
    lines = re.findall(r"The pass key of (\w+) is (\d{5})\.", s.document)
    assert len(lines) == 6 and len({n for n, _ in lines}) == 6
    asked = re.search(r"pass key of (\w+)\?", s.question).group(1)
    assert dict(lines)[asked] == s.answer


def test_invalid_arguments(embedded):
    _, tok = embedded
    with pytest.raises(ValueError, match="keys"):
        kv_retrieval(tok, 500, keys=0)
    with pytest.raises(ValueError, match="depth"):
        kv_retrieval(tok, 500, depth=1.5)
    with pytest.raises(ValueError, match="facts"):
        planted_facts(tok, 500, facts=0)
