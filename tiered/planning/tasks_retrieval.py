"""More offline retrieval tasks (beside tiered.planning.tasks): key-value lookup, planted facts in
real text.

- :func:`kv_retrieval`: a list of named pass keys (5-digit values) in filler; the question
  names one key. The lines look alike, so only the asked line's tokens tell the answer:
  selection must find the right line among its look-alikes and keep its digits exact.
- :func:`planted_facts`: several facts of one template (a person hid an object in a city)
  planted in ``pydoc_data.topics`` text; the question asks one person's city, the others are
  look-alike distractors.

Both return a :class:`tiered.planning.tasks.Sample` whose prompt ends where the answer starts.
"""

from __future__ import annotations

import random

from .tasks import FILLER, Sample, fit_to_length, topics_text

PEOPLE = ["Anna", "Boris", "Clara", "Diego", "Elena", "Farid", "Greta", "Hugo", "Ingrid",
          "Jonas", "Keiko", "Liam"]
OBJECTS = ["violin", "lantern", "compass", "teapot", "telescope", "kayak", "harp", "anchor",
           "globe", "clock", "mirror", "saddle"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Bergen", "Cusco",
          "Dublin", "Hanoi", "Perth", "Seville"]
KEY_NAMES = PEOPLE + ["Mara", "Nils", "Olga", "Pavel", "Rosa", "Sven", "Tara", "Uma", "Viktor",
                      "Wanda", "Yuri", "Zora"]


def kv_retrieval(tokenizer, n_tokens: int, *, seed: int = 0, keys: int = 6,
                 depth: float | None = None) -> Sample:
    """A list of ``keys`` lines "The pass key of <name> is <5 digits>." at ``depth`` (random if
    None) of ~n_tokens of filler; the question asks one name's key. (Measured with the full
    cache of the embedded SmolLM2-135M at 2k tokens: abstract keys such as "amber-badger: 12345"
    in a 150-line list were never answered, named pass keys in a short list were.)"""
    if not 1 <= keys <= len(KEY_NAMES):
        raise ValueError(f"Invalid keys: {keys!r} (expected 1..{len(KEY_NAMES)})")
    rng = random.Random(seed * 104729 + n_tokens + keys)
    depth = rng.uniform(0.05, 0.95) if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"Invalid depth: {depth!r} (expected 0 <= depth <= 1)")
    names = rng.sample(KEY_NAMES, keys)
    values = [str(rng.randrange(10000, 100000)) for _ in names]
    ask = rng.randrange(keys)
    listing = "".join(f"The pass key of {k} is {v}.\n" for k, v in zip(names, values))
    head = ("There is a list of pass keys hidden inside a lot of irrelevant text. Find it and "
            "memorize it.\n")
    question = f"What is the pass key of {names[ask]}? The pass key of {names[ask]} is"

    def make(k: int) -> str:
        at = int(k * depth)
        return head + FILLER * at + "\n" + listing + FILLER * (k - at) + question

    text, n = fit_to_length(tokenizer, make, n_tokens)
    return Sample(prompt=text, answer=values[ask], depth=depth, n_tokens=n, question=question)


def planted_facts(tokenizer, n_tokens: int, *, seed: int = 0, facts: int = 3) -> Sample:
    """``facts`` sentences "<person> hid the <object> in <city>." at random depths of real
    documentation text; the question asks where one person hid their object."""
    if not 1 <= facts <= len(PEOPLE):
        raise ValueError(f"Invalid facts: {facts!r} (expected 1..{len(PEOPLE)})")
    rng = random.Random(seed * 15485863 + n_tokens + facts)
    people = rng.sample(PEOPLE, facts)
    objects = rng.sample(OBJECTS, facts)
    cities = rng.sample(CITIES, facts)
    depths = sorted(rng.uniform(0.05, 0.95) for _ in range(facts))
    ask = rng.randrange(facts)
    corpus = topics_text()
    start = rng.randrange(0, len(corpus) // 2)
    question = (f"\n\nWhere did {people[ask]} hide the {objects[ask]}? {people[ask]} hid the "
                f"{objects[ask]} in")

    def make(k: int) -> str:
        body = corpus[start : start + 40 * k]
        parts, last = [], 0
        for p, o, c, d in zip(people, objects, cities, depths):
            at = int(len(body) * d)
            cut = body.rfind("\n", last, at)
            at = cut if cut > last else at
            parts.append(body[last:at])
            parts.append(f"\n{p} hid the {o} in {c}.\n")
            last = at
        parts.append(body[last:])
        return "".join(parts) + question

    text, n = fit_to_length(tokenizer, make, n_tokens)
    return Sample(prompt=text, answer=cities[ask], depth=depths[ask], n_tokens=n,
                  question=question)
