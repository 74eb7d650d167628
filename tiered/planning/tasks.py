"""Offline long-context tasks: passkey in generated filler, needles in real text.

Everything is built from text that ships with Python (no downloads): generated filler sentences,
and ``pydoc_data.topics`` (~465k characters of Python documentation) as natural text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    "There and back again. "
)


@dataclass
class Sample:
    """A long prompt with one right answer. ``prompt`` ends where the model should answer."""

    prompt: str
    answer: str
    depth: float  # where the needle sits, as a fraction of the document
    n_tokens: int  # prompt length in tokens
    question: str = ""  # the end of the prompt that asks (prompt = document + question)

    @property
    def document(self) -> str:
        return self.prompt[: len(self.prompt) - len(self.question)]


def fit_to_length(tokenizer, make, target_tokens: int) -> tuple[str, int]:
    """Largest ``make(k)`` (k filler units) whose token count stays <= target_tokens."""
    lo, hi = 1, 1
    while len(tokenizer.encode(make(hi))) <= target_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(tokenizer.encode(make(mid))) <= target_tokens:
            lo = mid
        else:
            hi = mid
    text = make(lo)
    return text, len(tokenizer.encode(text))


def passkey(tokenizer, n_tokens: int, depth: float, *, seed: int = 0, digits: int = 5) -> Sample:
    """A passkey hidden at ``depth`` (0..1) of ~``n_tokens`` tokens of repeated filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"Invalid depth: {depth!r} (expected 0 <= depth <= 1)")
    rng = random.Random(seed * 1000003 + int(depth * 1000) + n_tokens)
    key = str(rng.randrange(10 ** (digits - 1), 10**digits))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    head = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there. ")
    question = "What is the pass key? The pass key is"

    def make(k: int) -> str:
        at = int(round(k * depth))
        return head + FILLER * at + needle + FILLER * (k - at) + question

    text, n = fit_to_length(tokenizer, make, n_tokens)
    return Sample(prompt=text, answer=key, depth=depth, n_tokens=n, question=question)


NAMES = ["Alder", "Birch", "Cedar", "Dahlia", "Elm", "Fern", "Ginkgo", "Hazel", "Iris", "Juniper"]


def multi_needle(tokenizer, n_tokens: int, *, needles: int = 4, ask: int | None = None,
                 seed: int = 0) -> Sample:
    """Several pass keys, each with a name, spread through the filler; one of them is asked.

    Selection must keep more than one spot alive: the question names one key among several
    look-alikes."""
    rng = random.Random(seed * 31337 + n_tokens + needles)
    names = rng.sample(NAMES, needles)
    keys = [str(rng.randrange(10000, 100000)) for _ in range(needles)]
    ask = rng.randrange(needles) if ask is None else ask
    depths = sorted(rng.uniform(0.05, 0.95) for _ in range(needles))
    head = ("There are several pass keys hidden inside a lot of irrelevant text, each with a "
            "name. Memorize them all. ")
    question = f"What is the pass key of {names[ask]}? The pass key of {names[ask]} is"

    def make(k: int) -> str:
        parts, last = [head], 0
        for name, key, depth in zip(names, keys, depths):
            at = int(round(k * depth))
            parts.append(FILLER * (at - last))
            parts.append(f"The pass key of {name} is {key}. Remember it. ")
            last = at
        parts.append(FILLER * (k - last))
        parts.append(question)
        return "".join(parts)

    text, n = fit_to_length(tokenizer, make, n_tokens)
    return Sample(prompt=text, answer=keys[ask], depth=depths[ask], n_tokens=n, question=question)


def topics_text() -> str:
    """Natural text available on every Python install: the pydoc topic help pages."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def needle_in_text(tokenizer, n_tokens: int, depth: float, *, seed: int = 0) -> Sample:
    """A planted sentence with a made-up fact in real documentation text."""
    rng = random.Random(seed * 7919 + int(depth * 1000) + n_tokens)
    corpus = topics_text()
    cities = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Bergen", "Cusco"]
    items = ["violin", "lantern", "compass", "teapot", "telescope", "kayak", "harp", "anchor"]
    city, item = rng.choice(cities), rng.choice(items)
    needle = f"\nThe secret object hidden in {city} is a {item}.\n"
    question = f"\n\nWhat is the secret object hidden in {city}? The secret object hidden in {city} is a"
    start = rng.randrange(0, len(corpus) // 2)

    def make(k: int) -> str:
        body = corpus[start : start + 40 * k]
        at = int(len(body) * depth)
        cut = body.rfind("\n", 0, at)
        at = cut if cut > 0 else at
        return body[:at] + needle + body[at:] + question

    text, n = fit_to_length(tokenizer, make, n_tokens)
    return Sample(prompt=text, answer=item, depth=depth, n_tokens=n, question=question)


def is_correct(answer: str, generated: str, within: int = 12) -> bool:
    """The answer, as a whole word (exact match: '6072' is not '60725'), among the first
    ``within`` words of the generation (the model may restate the question first)."""
    words = re.findall(r"[a-z0-9]+", generated.lower())[:within]
    return answer.lower() in words
