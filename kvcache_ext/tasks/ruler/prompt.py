"""A RULER-style prompt: its token ids, where its question starts, and its answers; and RULER's
metric (string match over every expected answer)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvcache_ext.tasks.passkey import _encode, _token_bounds


@dataclass
class RulerPrompt:
    """One prompt of a RULER-style task. ``input_ids`` is what the model is given (1-D)."""
    task: str                  # e.g. "niah_single_1"
    prompt: str                # the full text (chat template applied when ``chat``)
    input_ids: torch.Tensor    # 1-D LongTensor, ``length`` tokens
    answers: list[str]         # every string the answer must contain
    n_tokens: int              # length asked for
    length: int                # actual tokens (<= n_tokens)
    haystack_end: int          # index of the question's first token: what agnostic mode compresses ends here
    depth: float | None        # where the (first) asked needle sits in the context, 0 to 1; None: no needle
    seed: int
    chat: bool
    max_new_tokens: int        # RULER's generation length for the task

    @property
    def answer(self) -> str:
        """The answers as one string (for records and tables)."""
        return ", ".join(self.answers)

    def score(self, text: str) -> float:
        return string_match_all(text, self.answers)


def string_match_all(text: str, answers: list[str]) -> float:
    """RULER's metric of one output: the share of the expected answers found in it
    (case-insensitive substring)."""
    low = text.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def render(tokenizer, task: str, instruction: str, context: str, question: str, answer_prefix: str,
           answers: list[str], n_tokens: int, seed: int, chat: bool, max_new_tokens: int,
           depth: float | None = None) -> RulerPrompt:
    """The prompt "instruction / context / question" as the user's turn, the assistant's turn
    opened with ``answer_prefix`` (RULER's template per task)."""
    user = f"{instruction}\n\n{context}\n\n{question}" if instruction else f"{context}\n\n{question}"
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat=True needs a tokenizer with a chat template; pass chat=False")
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True) + answer_prefix
    else:
        text = f"{user}\n\n{answer_prefix}"
    ids = _encode(tokenizer, text, chat)
    question_at = text.rindex(question)
    (question_start,) = _token_bounds(tokenizer, text, (question_at,), (), chat)
    return RulerPrompt(task=task, prompt=text, input_ids=torch.tensor(ids, dtype=torch.long), answers=answers,
                       n_tokens=n_tokens, length=len(ids), haystack_end=question_start, depth=depth, seed=seed,
                       chat=chat, max_new_tokens=max_new_tokens)


def fit(make: Callable[[int], RulerPrompt], n_tokens: int, most: int | None = None) -> RulerPrompt:
    """The prompt ``make(k)`` of the largest ``k`` (filler units, at most ``most``) that is at most
    ``n_tokens`` tokens long; ``make(k)`` must grow with ``k``. Raises ValueError when even ``k = 0``
    is too long, or ``k = most`` still too short."""
    empty = make(0)
    if empty.length > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is shorter than the {empty.task} prompt without filler "
                         f"({empty.length} tokens)")
    if most is not None and make(most).length <= n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is longer than a {empty.task} prompt can be here "
                         f"({make(most).length} tokens)")
    lo, hi, best = 0, 16, empty
    while (most is None or hi < most) and (p := make(hi)).length <= n_tokens:
        lo, hi, best = hi, hi * 2, p
    if most is not None:
        hi = min(hi, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = make(mid)
        if p.length <= n_tokens:
            lo, best = mid, p
        else:
            hi = mid
    return best
