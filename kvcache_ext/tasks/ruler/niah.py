"""RULER's needle-in-a-haystack variants: find the value(s) stated for a key in a long text.

A needle is "One of the special magic numbers for quiet-harbour is: 3336625." The eight variants
(RULER's configuration) differ in the haystack, the kind of key and value, and how many needles
there are and are asked for:

==================  ===========  ======  ======  ====  ======  =======
task                haystack     key     value   keys  values  queries
==================  ===========  ======  ======  ====  ======  =======
niah_single_1       noise        words   numbers  1     1       1
niah_single_2       essay        words   numbers  1     1       1
niah_single_3       essay        words   uuids    1     1       1
niah_multikey_1     essay        words   numbers  4     1       1
niah_multikey_2     needle       words   numbers  1     1       1
niah_multikey_3     needle       uuids   uuids    1     1       1
niah_multivalue     essay        words   numbers  1     4       1
niah_multiquery     essay        words   numbers  4     1       4
==================  ===========  ======  ======  ====  ======  =======

``noise``: RULER's five plain sentences repeated; ``essay``: the shipped prose (RULER's is Paul
Graham's essays); ``needle``: the haystack is made of needles for other keys only. Extra keys
(``keys`` > ``queries``) are distractors. Every value of every asked key must be in the answer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvcache_ext.tasks.ruler.haystack import (NOISE, distinct, essay_sentences, insert_at_depths, number,
                                              uuid_text, word_key)
from kvcache_ext.tasks.ruler.prompt import RulerPrompt, fit, render

NOISE_SENTENCES = [s.rstrip(".") + "." for s in NOISE.split(". ")]
DEPTH_STEPS = 40          # RULER's needle depths: 40 evenly spaced places from 0 to 1
MAX_NEW_TOKENS = 128      # RULER's tokens_to_generate for the needle tasks


@dataclass(frozen=True)
class Niah:
    haystack: str        # "noise", "essay" or "needle"
    key: str             # "words", "numbers" or "uuids"
    value: str           # "numbers" or "uuids"
    keys: int = 1        # needles' keys (the asked ones first, then distractors)
    values: int = 1      # values per key
    queries: int = 1     # keys asked for


VARIANTS = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", keys=4, queries=4),
}
DRAW = {"words": word_key, "numbers": number, "uuids": uuid_text}


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def make_niah_prompt(tokenizer, task: str, n_tokens: int, seed: int = 0, chat: bool = True) -> RulerPrompt:
    """A prompt of ``task`` (a key of ``VARIANTS``) of at most ``n_tokens`` tokens."""
    spec = VARIANTS[task]
    rng = random.Random(f"{task}-{seed}")
    keys = distinct(lambda: DRAW[spec.key](rng), spec.keys)
    values = {k: distinct(lambda: DRAW[spec.value](rng), spec.values) for k in keys}
    needles = [_needle(spec.value, k, v) for k in keys for v in values[k]]
    rng.shuffle(needles)
    depths = sorted(rng.sample(range(DEPTH_STEPS), len(needles)))
    depths = [d / (DEPTH_STEPS - 1) for d in depths]
    asked = keys[:spec.queries]
    answers = [v for k in asked for v in values[k]]
    start = rng.randrange(10_000)
    # A haystack of needles holds as many as fit: drawn once, as many as a prompt could hold.
    distractor_keys = distinct(lambda: DRAW[spec.key](rng), n_tokens // 8, avoid=keys) if spec.haystack == "needle" else []
    distractor_values = [DRAW[spec.value](rng) for _ in distractor_keys]

    def filler(k: int) -> list[str]:
        if spec.haystack == "noise":
            return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(k)]
        if spec.haystack == "essay":
            return essay_sentences(start, k)
        return [_needle(spec.value, dk, dv) for dk, dv in zip(distractor_keys[:k], distractor_values)]

    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    kind = spec.value
    instruction = (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                   f"I will quiz you about the {kind} afterwards.")
    question = f"What are all the special magic {kind} for {query} mentioned in the provided text?"
    answer_prefix = f"The special magic {kind} for {query} mentioned in the provided text are"
    first = next(i for i, n in enumerate(needles) if any(v in n for v in answers))

    def make(k: int) -> RulerPrompt:
        units = insert_at_depths(filler(k), needles, depths)
        context = ("\n" if spec.haystack == "needle" else " ").join(units)
        return render(tokenizer, task, instruction, context, question, answer_prefix, answers, n_tokens, seed,
                      chat, MAX_NEW_TOKENS, depth=depths[first])

    return fit(make, n_tokens, most=len(distractor_keys) if spec.haystack == "needle" else None)
