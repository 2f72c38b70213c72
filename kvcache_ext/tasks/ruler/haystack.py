"""What RULER-style prompts are made of: haystacks, word lists, random values, and random values.

Everything is generated offline from the prose shipped with the package
(``kvcache_ext/data/haystack.txt``) and a seeded ``random.Random``: the same seed and
tokenizer give the same prompt on every machine.
"""
from __future__ import annotations

import random
import re
import uuid
from functools import lru_cache
from typing import Callable

from kvcache_ext.tasks.passkey import _corpus_units, corpus_text

# RULER's "noise" haystack: one paragraph of plain statements, repeated.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words of 4 to 10 letters from the shipped prose, sorted: the words
    RULER draws from the ``wonderwords`` lists (keys, common-words lists)."""
    words = {w for w in re.findall(r"[A-Za-z]+", corpus_text()) if w.islower() and 4 <= len(w) <= 10}
    return tuple(sorted(words))


def essay_sentences(start: int, count: int) -> list[str]:
    """``count`` sentences of the prose from sentence ``start`` on (read cyclically)."""
    units = _corpus_units()
    return [units[(start + i) % len(units)][0] for i in range(count)]


def number(rng: random.Random, digits: int = 7) -> str:
    """A random number of ``digits`` digits (no leading zero)."""
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def uuid_text(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def word_key(rng: random.Random) -> str:
    """Two words joined by a hyphen ("quiet-harbour"), as RULER's adjective-noun keys."""
    words = vocabulary()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def distinct(draw: Callable[[], str], count: int, avoid=()) -> list[str]:
    """``count`` distinct values of ``draw()`` that are not in ``avoid``."""
    seen, out = set(avoid), []
    while len(out) < count:
        value = draw()
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def insert_at_depths(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """``units`` with each needle placed before unit ``round(depth * len(units))`` (in the
    needles' order where two land at one place)."""
    out, at = [], 0
    places = [round(d * len(units)) for d in depths]
    for needle, place in sorted(zip(needles, places), key=lambda p: p[1]):
        out += units[at:place] + [needle]
        at = place
    return out + units[at:]
