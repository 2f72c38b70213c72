"""Needle in a haystack: a made-up fact, stated once in a long stretch of prose, asked for at the end.

The passkey task hides a number; this one hides a sentence in the same register as the filler
(``kvcache_ext/data/haystack.txt``), so the needle does not stand out by its form and the model
must retrieve a word, not copy digits. The facts are invented (so the model cannot know them)
and their answer words do not occur in the corpus (checked by ``tests/test_tasks.py``).

    p = make_needle_prompt(tokenizer, n_tokens=2000, depth=0.5, seed=3)
    text, correct = run_passkey(model, tokenizer, p)   # same runner: the answer is p.answer
"""
from __future__ import annotations

import random
from typing import NamedTuple

from kvcache_ext.tasks.passkey import (
    PasskeyPrompt,
    PromptTexts,
    _corpus_units,
    make_retrieval_prompt,
)

INSTRUCTION = ("Read the long text below carefully. One sentence in it states an unusual fact; "
               "I will ask you about it at the end.")


class Fact(NamedTuple):
    needle: str          # the sentence planted in the prose
    question: str        # asked after the prose
    answer_prefix: str   # opens the assistant's answer, so the next words are the answer
    answer: str          # one word; matched case-insensitively in the generated text


FACTS = (
    Fact("The lighthouse keeper on Gull Island is a quiet man called Ansgar.",
         "What is the name of the lighthouse keeper on Gull Island?",
         "The lighthouse keeper on Gull Island is called", "Ansgar"),
    Fact("Marta's famous lemon cake owes its flavour to a pinch of cardamom.",
         "What spice gives Marta's lemon cake its flavour?",
         "Marta's lemon cake owes its flavour to", "cardamom"),
    Fact("The village choir rehearses every Thursday inside an old observatory.",
         "Where does the village choir rehearse?",
         "The village choir rehearses inside an old", "observatory"),
    Fact("Professor Lind keeps a tortoise named Archimedes in her office.",
         "What is the name of the tortoise in Professor Lind's office?",
         "The tortoise in Professor Lind's office is named", "Archimedes"),
    Fact("The night train to Vellmar always leaves from platform eleven.",
         "From which platform does the night train to Vellmar leave?",
         "The night train to Vellmar leaves from platform", "eleven"),
    Fact("Old Tomas carved the bench by the harbour out of a single piece of walnut.",
         "Out of which wood did Old Tomas carve the bench by the harbour?",
         "Old Tomas carved the bench out of", "walnut"),
    Fact("The chess club's secret password is the word marmalade.",
         "What is the chess club's secret password?",
         "The chess club's secret password is the word", "marmalade"),
    Fact("Every summer the twins sail to the island of Korvella to pick cherries.",
         "To which island do the twins sail every summer?",
         "Every summer the twins sail to the island of", "Korvella"),
    Fact("The baker on Mill Street hides a brass key under a flowerpot shaped like a pelican.",
         "What is the flowerpot that hides the baker's key shaped like?",
         "The flowerpot is shaped like a", "pelican"),
    Fact("The museum's oldest clock was built by a watchmaker called Ferreira.",
         "Who built the museum's oldest clock?",
         "The museum's oldest clock was built by a watchmaker called", "Ferreira"),
    Fact("Grandfather gave his old violin a name: he calls it Rosalind.",
         "What does grandfather call his old violin?",
         "Grandfather calls his old violin", "Rosalind"),
    Fact("The mayor's dog, a shaggy sheepdog, answers only to the name Biscuit.",
         "What name does the mayor's dog answer to?",
         "The mayor's dog answers to the name", "Biscuit"),
)


def make_needle_prompt(tokenizer, n_tokens: int, depth: float, seed: int = 0,
                       chat: bool | None = None) -> PasskeyPrompt:
    """A needle prompt of ``n_tokens`` tokens (or a few fewer) with the fact at ``depth``.

    The seed chooses the fact (``FACTS[seed % len(FACTS)]``) and where the filler starts."""
    fact = FACTS[seed % len(FACTS)]
    start = random.Random(f"needle-{seed}").randrange(len(_corpus_units()))
    texts = PromptTexts(INSTRUCTION, fact.needle, fact.question, fact.answer_prefix)
    return make_retrieval_prompt(tokenizer, n_tokens, depth, texts, fact.answer, start, seed=seed, chat=chat)


__all__ = ["FACTS", "Fact", "make_needle_prompt"]
