"""More offline retrieval tasks (beside tiered.tasks): key-value lookup, planted facts in real text.

- :func:`kv_retrieval`: a long list of ``key: value`` lines (made-up two-word keys, 5-digit
  values); the question names one key. Every line looks alike, so only the asked line's tokens
  tell the answer: selection must find one line among hundreds, and keep its digits exact.
- :func:`planted_facts`: several facts of one template (a person keeps an object in a city)
  planted in ``pydoc_data.topics`` text; the question asks one person's city, the others are
  look-alike distractors.

Both return a :class:`tiered.tasks.Sample` whose prompt ends where the answer starts.
"""

from __future__ import annotations

import random

from .tasks import Sample, _fit, topics_text

ADJECTIVES = ["amber", "brisk", "coral", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy",
              "jolly", "lunar", "misty", "noble", "olive", "proud", "quiet", "rapid", "silver",
              "tidy", "urban", "vivid", "woolly", "young", "zesty"]
NOUNS = ["badger", "canyon", "dragon", "falcon", "garden", "harbor", "island", "jaguar",
         "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quartz", "river",
         "saddle", "tunnel", "valley", "walrus", "willow", "yonder", "zephyr", "beacon"]
PEOPLE = ["Anna", "Boris", "Clara", "Diego", "Elena", "Farid", "Greta", "Hugo", "Ingrid",
          "Jonas", "Keiko", "Liam"]
OBJECTS = ["violin", "lantern", "compass", "teapot", "telescope", "kayak", "harp", "anchor",
           "globe", "clock", "mirror", "saddle"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Bergen", "Cusco",
          "Dublin", "Hanoi", "Perth", "Seville"]


def kv_retrieval(tokenizer, n_tokens: int, *, seed: int = 0, depth: float | None = None) -> Sample:
    """~n_tokens of ``key: value`` lines; the asked key sits at ``depth`` (random if None)."""
    rng = random.Random(seed * 104729 + n_tokens)
    depth = rng.uniform(0.05, 0.95) if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"Invalid depth: {depth!r} (expected 0 <= depth <= 1)")
    pairs = [(a, b) for a in ADJECTIVES for b in NOUNS]
    rng.shuffle(pairs)
    keys = [f"{a}-{b}" for a, b in pairs]
    values = [str(rng.randrange(10000, 100000)) for _ in keys]
    head = ("Below is a list of keys and their values. Remember them; you will be asked for "
            "the value of one key.\n")

    def make(k: int) -> tuple[str, int]:
        k = min(k, len(keys))
        at = min(k - 1, int(round((k - 1) * depth)))
        lines = "".join(f"{keys[i]}: {values[i]}\n" for i in range(k))
        return lines, at

    def prompt(k: int) -> str:
        lines, at = make(k)
        key = keys[at]
        return head + lines + f"\nWhat is the value of {key}? The value of {key} is"

    lo = 1
    while lo * 2 <= len(keys) and len(tokenizer.encode(prompt(lo * 2))) <= n_tokens:
        lo *= 2
    hi = min(lo * 2, len(keys))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(tokenizer.encode(prompt(mid))) <= n_tokens:
            lo = mid
        else:
            hi = mid
    text = prompt(lo)
    _, at = make(lo)
    question = f"\nWhat is the value of {keys[at]}? The value of {keys[at]} is"
    return Sample(prompt=text, answer=values[at], depth=at / max(lo - 1, 1),
                  n_tokens=len(tokenizer.encode(text)), question=question)


def planted_facts(tokenizer, n_tokens: int, *, seed: int = 0, facts: int = 4) -> Sample:
    """``facts`` sentences "<person> keeps the <object> in <city>." at random depths of real
    documentation text; the question asks where one person keeps their object."""
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
    question = (f"\n\nQuestion: in which city does {people[ask]} keep the {objects[ask]}? "
                f"Answer: {people[ask]} keeps the {objects[ask]} in")

    def make(k: int) -> str:
        body = corpus[start : start + 40 * k]
        parts, last = [], 0
        for p, o, c, d in zip(people, objects, cities, depths):
            at = int(len(body) * d)
            cut = body.rfind("\n", last, at)
            at = cut if cut > last else at
            parts.append(body[last:at])
            parts.append(f"\n{p} keeps the {o} in {c}.\n")
            last = at
        parts.append(body[last:])
        return "".join(parts) + question

    text, n = _fit(tokenizer, make, n_tokens)
    return Sample(prompt=text, answer=cities[ask], depth=depths[ask], n_tokens=n,
                  question=question)
