"""Several questions about one long context: what a cache compressed once must answer.

The context is an instruction and filler prose with three facts of the needle task in it (drawn
by the seed from ``needle.FACTS``), each in its own paragraph at its own depth. It is compressed
before any question exists; then the questions come one after another as turns of one chat on
the same cache, each turn's question and the model's answer appended to it (what a chat over a
long document does), so a later question is asked over the earlier turns too.

    p = make_multi_question_prompt(tokenizer, 2048, seed=0)
    p.context            # [n] token ids: chat prefix, instruction, filler with the keys
    p.turns[i]           # [m] token ids of question i: (the end of the previous answer,) the
                         # question, and the opening of its answer
    p.questions[i]       # question i as the first turn after the context: a request of its own
                         # (context + questions[i]), as many requests share one context
    p.answers[i]         # the word question i asks for; p.depths[i] where its fact is

Three pass keys of one form ("the pass key of the blue door is ...") were tried first: the
default model with its full cache mixed them up (0 of 3 on a 1K context), so the facts differ.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvcache_ext.tasks.needle import FACTS
from kvcache_ext.tasks.passkey import _corpus_units, _join

DEPTHS = (0.2, 0.5, 0.8)
INSTRUCTION = ("Read the long text below carefully. A few sentences in it state unusual facts; "
               "I will ask you about them afterwards.")


@dataclass
class MultiQuestionPrompt:
    context: torch.Tensor          # [n] token ids compressed before the questions
    turns: list[torch.Tensor]      # per question, [m] token ids fed after the previous answer
    questions: list[torch.Tensor]  # per question, [m] token ids of it asked first, right after the context
    answers: list[str]
    depths: list[float]
    length: int                    # tokens of the context
    seed: int


def _chat_markers(tokenizer) -> tuple[str, str, str]:
    """(user turn opening, user turn end + assistant opening, assistant turn end) of the template."""
    mark_user, mark_answer = "\x00USER\x00", "\x00ANSWER\x00"
    one = tokenizer.apply_chat_template([{"role": "user", "content": mark_user}], tokenize=False,
                                        add_generation_prompt=True)
    two = tokenizer.apply_chat_template([{"role": "user", "content": mark_user},
                                         {"role": "assistant", "content": mark_answer},
                                         {"role": "user", "content": mark_user}], tokenize=False,
                                        add_generation_prompt=True)
    opening, to_answer = one.split(mark_user)
    after_answer = two.split(mark_answer)[1].split(mark_user)[0]   # assistant end + next user opening
    return opening, to_answer, after_answer


def make_multi_question_prompt(tokenizer, n_tokens: int, seed: int = 0) -> MultiQuestionPrompt:
    """A context of about ``n_tokens`` tokens (a few fewer) with a fact at each of ``DEPTHS``,
    asked in an order drawn from ``seed``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the multi-question task needs a tokenizer with a chat template")
    rng = random.Random(seed)
    facts = rng.sample(FACTS, len(DEPTHS))
    units = _corpus_units()
    start = rng.randrange(len(units))
    opening, to_answer, after_answer = _chat_markers(tokenizer)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    needles = [fact.needle for fact in facts]
    fixed = count(opening + INSTRUCTION + "\n\n" + "\n\n".join(needles))
    chosen, total = [], fixed
    while True:   # whole sentences while they fit (tokens counted one sentence at a time)
        sentence = units[(start + len(chosen)) % len(units)]
        extra = count(" " + sentence[0])
        if total + extra > n_tokens:
            break
        chosen.append(sentence)
        total += extra
    if not chosen:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for filler ({fixed} tokens without it)")
    def render(sentences):
        cuts = [round(d * len(sentences)) for d in DEPTHS]
        parts, at = [], 0
        for cut, needle in zip(cuts, needles):
            parts += [_join(sentences[at:cut]), needle]
            at = cut
        parts.append(_join(sentences[at:]))
        return opening + INSTRUCTION + "\n\n" + "\n\n".join(p for p in parts if p)

    context_text = render(chosen)
    while count(context_text) > n_tokens and len(chosen) > 1:   # the joins cost a few tokens more
        chosen.pop()
        context_text = render(chosen)
    order = list(range(len(facts)))
    rng.shuffle(order)
    ids = lambda text: torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])   # noqa: E731
    turns, questions = [], []
    for i, q in enumerate(order):
        asked = facts[q].question + to_answer + facts[q].answer_prefix
        turns.append(ids(("\n\n" if i == 0 else after_answer) + asked))
        questions.append(ids("\n\n" + asked))
    context = torch.tensor(tokenizer(context_text, add_special_tokens=False)["input_ids"])
    return MultiQuestionPrompt(context=context, turns=turns, questions=questions, answers=[facts[q].answer for q in order],
                               depths=[DEPTHS[q] for q in order], length=context.numel(), seed=seed)
