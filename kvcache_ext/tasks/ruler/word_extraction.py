"""RULER's aggregation tasks: which words occur most often in a long list or text.

- ``cwe`` (common words extraction): a numbered list of words in which 10 words occur 30 times
  each and the others 3 times each (RULER's setting for long contexts); the answer must name
  the 10 common words. When the prompt is too short for 10 x 30 entries, each common word
  occurs as often as fits while staying above the others (at least 4 times).
- ``fwe`` (frequent words extraction): a text of made-up six-letter "coded" words whose ranks
  follow a Zipf law (alpha 2); the most frequent "word" is "...." (the question says to ignore
  the dots); the answer must name the three most frequent coded words.
"""
from __future__ import annotations

import random
import string
from collections import Counter

from kvcache_ext.tasks.ruler.haystack import vocabulary
from kvcache_ext.tasks.ruler.prompt import RulerPrompt, fit, render

COMMON_WORDS, COMMON_TIMES, RARE_TIMES = 10, 30, 3
ZIPF_ALPHA, CODED_LENGTH, FREQUENT = 2.0, 6, 3
MAX_NEW_TOKENS = {"cwe": 120, "fwe": 50}   # RULER's tokens_to_generate


def make_common_words_prompt(tokenizer, task: str, n_tokens: int, seed: int = 0, chat: bool = True) -> RulerPrompt:
    rng = random.Random(f"{task}-{seed}")
    words = list(vocabulary())
    rng.shuffle(words)
    common, rare = words[:COMMON_WORDS], words[COMMON_WORDS:]
    instruction = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.")
    question = f"Question: What are the {COMMON_WORDS} most common words in the above list?"
    answer_prefix = f"Answer: The top {COMMON_WORDS} words that appear most often in the list are:"

    def maker(times: int):
        def make(k: int) -> RulerPrompt:
            entries = common * times + rare[:k] * RARE_TIMES
            random.Random(f"{task}-{seed}-{times}-{k}").shuffle(entries)
            context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
            return render(tokenizer, task, instruction, context, question, answer_prefix, common, n_tokens, seed,
                          chat, MAX_NEW_TOKENS[task])
        return make

    # As often as fits: the most repeats of the common words whose list without rare words fits.
    times = next((t for t in range(COMMON_TIMES, RARE_TIMES, -1) if maker(t)(0).length <= n_tokens),
                 RARE_TIMES + 1)   # none fits: fit() says how long the shortest list is
    return fit(maker(times), n_tokens, most=len(rare))


def make_frequent_words_prompt(tokenizer, task: str, n_tokens: int, seed: int = 0, chat: bool = True) -> RulerPrompt:
    rng = random.Random(f"{task}-{seed}")
    coded = sorted({"".join(rng.choice(string.ascii_lowercase) for _ in range(CODED_LENGTH)) for _ in range(2000)})
    rng.shuffle(coded)
    vocab = ["...."] + coded   # by rank: the dots are the most frequent
    ranks = [1.0 / (r + 1) ** ZIPF_ALPHA for r in range(len(vocab))]
    stream = rng.choices(range(len(vocab)), weights=ranks, k=n_tokens)   # more words than any prompt holds
    instruction = ("Read the following coded text and track the frequency of each coded word. "
                   "Find the three most frequently appeared coded words.")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
    answer_prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"

    def top(k: int) -> list[str]:
        counts = Counter(vocab[r] for r in stream[:k] if r != 0).most_common(FREQUENT + 1)
        return [w for w, _ in counts[:FREQUENT]]

    def make(k: int) -> RulerPrompt:
        context = " ".join(vocab[r] for r in stream[:k])
        return render(tokenizer, task, instruction, context, question, answer_prefix, top(k), n_tokens, seed,
                      chat, MAX_NEW_TOKENS[task])

    return fit(make, n_tokens, most=len(stream))
