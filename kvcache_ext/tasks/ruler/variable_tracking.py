"""RULER's variable tracking: follow a chain of assignments hidden in a long text.

"VAR QPZKT = 48213" starts a chain, each next link assigns the previous variable
("VAR MWHAE = VAR QPZKT"), four hops in all (RULER's default: one chain, four hops), so five
variable names hold the value; the links sit in order at random places of the noise haystack.
The question gives the value and asks for every variable that holds it: all five must be in
the answer.
"""
from __future__ import annotations

import random
import string

from kvcache_ext.tasks.ruler.haystack import distinct, insert_at_depths
from kvcache_ext.tasks.ruler.niah import NOISE_SENTENCES
from kvcache_ext.tasks.ruler.prompt import RulerPrompt, fit, render

HOPS = 4
MAX_NEW_TOKENS = 30   # RULER's tokens_to_generate for the task


def make_variable_tracking_prompt(tokenizer, task: str, n_tokens: int, seed: int = 0,
                                  chat: bool = True) -> RulerPrompt:
    rng = random.Random(f"{task}-{seed}")
    names = distinct(lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(5)), HOPS + 1)
    value = str(rng.randrange(10_000, 100_000))
    links = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(HOPS)]
    depths = sorted(rng.random() for _ in links)   # the chain in order, at random places
    instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    answer_prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
                     f"{HOPS + 1} variables are assigned the value {value}, they are:")

    def make(k: int) -> RulerPrompt:
        filler = [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(k)]
        context = " ".join(insert_at_depths(filler, links, depths))
        return render(tokenizer, task, instruction, context, question, answer_prefix, names, n_tokens, seed,
                      chat, MAX_NEW_TOKENS, depth=depths[0])

    return fit(make, n_tokens)
