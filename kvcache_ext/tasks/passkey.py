"""Passkey retrieval: find a five-digit number hidden at a chosen depth in a long stretch of prose.

A prompt is an instruction, then filler prose from the corpus shipped with the package
(``kvcache_ext/data/haystack.txt``, plain paragraphs on everyday topics, no digits in it) with the
needle

    The pass key is 48213. Remember it. 48213 is the pass key.

inserted as its own paragraph at relative depth ``depth`` of the filler (0 = first, 1 = last), then
the question. With ``chat=True`` the user turn goes through the tokenizer's chat template and the
assistant turn is opened with "The pass key is", so that the next tokens the model writes are the
digits. The total length is fitted to ``n_tokens`` exactly or a few tokens under it: whole
sentences first, then words of one more sentence.

The seed picks the passkey and where in the corpus the filler starts (the corpus is read
cyclically, so any length works; about 10K tokens of it come before the first repeat).

    p = make_passkey_prompt(tokenizer, n_tokens=2000, depth=0.5, seed=3)
    text, correct = run_passkey(model, tokenizer, p)   # (" 41190.", True)

The unpatched default model (SmolLM2-135M-Instruct, greedy) answers nearly every prompt up to its
context limit, so a miss under eviction is the policy's; docs/results.md has its counts (the
``full`` rows).
"""
from __future__ import annotations

import bisect
import importlib.resources
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch

INSTRUCTION = ("There is a pass key hidden inside the long text below. Find it and memorize it; "
               "I will ask you for the pass key at the end.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"


@dataclass
class PasskeyPrompt:
    """One retrieval prompt (passkey or needle). ``input_ids`` is what the model is given (1-D, no batch dimension)."""
    prompt: str                # the full prompt text (chat template applied when ``chat``)
    input_ids: torch.Tensor    # 1-D LongTensor, ``length`` tokens
    answer: str                # the pass key (five digits unless one was given)
    n_tokens: int              # length asked for
    length: int                # actual number of tokens (== input_ids.numel(), <= n_tokens)
    depth: float               # depth asked for, in [0, 1]
    needle_depth: float        # actual depth: share of the filler tokens that come before the needle
    needle_start: int          # index in input_ids of the needle's first token
    needle_end: int            # index one past the needle's last token
    haystack_start: int        # index of the first filler token
    haystack_end: int          # index one past the last filler token
    seed: int
    chat: bool
    extra: dict = field(default_factory=dict)

    def score(self, text: str) -> float:
        """1.0 when ``text`` holds the answer (``check_answer``), else 0.0."""
        return float(check_answer(text, self.answer))


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """The filler corpus shipped with the package."""
    return importlib.resources.files("kvcache_ext").joinpath("data/haystack.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _corpus_units() -> Tuple[Tuple[str, bool], ...]:
    """The corpus as (sentence, ends_a_paragraph) pairs, in order."""
    units = []
    for paragraph in re.split(r"\n\s*\n", corpus_text()):
        paragraph = " ".join(paragraph.split())
        if not paragraph:
            continue
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s]
        units += [(s, i == len(sentences) - 1) for i, s in enumerate(sentences)]
    return tuple(units)


def _join(units: Sequence[Tuple[str, bool]]) -> str:
    parts = []
    for i, (sentence, paragraph_end) in enumerate(units):
        parts.append(sentence)
        if i + 1 < len(units):
            parts.append("\n\n" if paragraph_end else " ")
    return "".join(parts)


@dataclass(frozen=True)
class PromptTexts:
    """The fixed texts of a retrieval prompt around the filler."""
    instruction: str
    needle: str
    question: str
    answer_prefix: str



def _render(tokenizer, before: str, texts: PromptTexts, after: str, chat: bool) -> Tuple[str, int, int, int, int]:
    """Full prompt text and the character spans of the haystack and of the needle in it."""
    needle = texts.needle
    pieces = [before, needle, after]
    haystack = "\n\n".join(p for p in pieces if p)
    user = f"{texts.instruction}\n\n{haystack}\n\n{texts.question}"
    if chat:
        messages = [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text += texts.answer_prefix
    else:
        text = f"{user}\n\n{texts.answer_prefix}"
    h0 = text.index(haystack)
    n0 = h0 + haystack.index(needle)
    return text, h0, h0 + len(haystack), n0, n0 + len(needle)


def _encode(tokenizer, text: str, chat: bool) -> List[int]:
    # The chat template already holds the special tokens as text; plain prompts get the tokenizer's
    # usual ones (a BOS token for models that want one).
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def _token_bounds(tokenizer, text: str, starts: Sequence[int], ends: Sequence[int], chat: bool) -> List[int]:
    """Token indices of character spans of the prompt: for each start, the first token that reaches
    past it; for each end, one past the last token that begins before it."""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)["offset_mapping"]
        return ([sum(1 for _, e in offsets if e <= c) for c in starts]
                + [sum(1 for b, _ in offsets if b < c) for c in ends])
    # Slow tokenizers: count the tokens of the text up to the boundary.
    return [len(_encode(tokenizer, text[:c], chat)) if c else 0 for c in list(starts) + list(ends)]


def uses_chat(tokenizer, chat: Optional[bool]) -> bool:
    """``chat`` as given; ``None``: whether the tokenizer has a chat template (a base model's
    tokenizer has none, and its prompts are plain text)."""
    return bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat


def make_passkey_prompt(tokenizer, n_tokens: int, depth: float, passkey: Optional[str] = None,
                        seed: int = 0, chat: Optional[bool] = None) -> PasskeyPrompt:
    """A passkey prompt of ``n_tokens`` tokens (or a few fewer) with the needle at ``depth``.

    ``passkey`` defaults to a five-digit number drawn from ``seed``; the seed also chooses where in
    the corpus the filler starts. ``chat=True`` wraps the prompt in the tokenizer's chat template
    (which it must have) and opens the answer with "The pass key is"; ``chat=None`` (the default)
    does when the tokenizer has a chat template.
    """
    rng = random.Random(seed)
    drawn = str(rng.randint(10000, 99999))  # drawn always, so that the filler does not depend on passkey
    key = str(passkey) if passkey is not None else drawn
    start = rng.randrange(len(_corpus_units()))
    texts = PromptTexts(INSTRUCTION, NEEDLE.format(key=key), QUESTION, ANSWER_PREFIX)
    return make_retrieval_prompt(tokenizer, n_tokens, depth, texts, key, start, seed=seed, chat=chat)


def make_retrieval_prompt(tokenizer, n_tokens: int, depth: float, texts: PromptTexts, answer: str,
                          corpus_start: int, seed: int = 0, chat: Optional[bool] = None) -> PasskeyPrompt:
    """The prompt of ``texts`` fitted to ``n_tokens``: filler read from sentence ``corpus_start``
    of the corpus, with ``texts.needle`` as its own paragraph at ``depth`` of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    chat = uses_chat(tokenizer, chat)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True needs a tokenizer with a chat template; pass chat=False")
    start = corpus_start % len(_corpus_units())
    key = answer

    units = _corpus_units()

    def filler(n_units: int, n_words: int = 0) -> List[Tuple[str, bool]]:
        chosen = [units[(start + i) % len(units)] for i in range(n_units)]
        if n_words:
            words = units[(start + n_units) % len(units)][0].split()[:n_words]
            chosen.append((" ".join(words), True))
        return chosen

    # Approximate token counts of the sentences give the needle's place; exact tokenization of the
    # whole prompt gives the length.
    unit_tokens = {}

    def approx_tokens(sentence: str) -> int:
        if sentence not in unit_tokens:
            unit_tokens[sentence] = len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
        return unit_tokens[sentence]

    def build(n_units: int, n_words: int = 0):
        chosen = filler(n_units, n_words)
        cum = [0]
        for sentence, _ in chosen:
            cum.append(cum[-1] + approx_tokens(sentence))
        target = depth * cum[-1]
        k = bisect.bisect_left(cum, target)
        if k > 0 and (k == len(cum) or target - cum[k - 1] <= cum[k] - target):
            k -= 1
        text, h0, h1, n0, n1 = _render(tokenizer, _join(chosen[:k]), texts, _join(chosen[k:]), chat)
        return text, _encode(tokenizer, text, chat), (h0, h1, n0, n1)

    empty_len = len(build(0)[1])
    if empty_len > n_tokens:
        raise ValueError(
            f"n_tokens={n_tokens} is shorter than the prompt without filler ({empty_len} tokens)")

    def fits(n_units: int, n_words: int = 0) -> bool:
        return len(build(n_units, n_words)[1]) <= n_tokens

    # Largest number of whole sentences that fits: grow an upper bound, then bisect.
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    n_units, n_words = lo, 0
    text, ids, spans = build(n_units)
    if n_tokens - len(ids) > max(2, n_tokens // 200):  # top up with words of the next sentence
        words = len(units[(start + n_units) % len(units)][0].split())
        lo, hi = 0, words
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(n_units, mid) else (lo, mid)
        if lo:
            n_words = lo
            text, ids, spans = build(n_units, n_words)

    h0, h1, n0, n1 = spans
    hs, ns, he, ne = _token_bounds(tokenizer, text, (h0, n0), (h1, n1), chat)
    filler_tokens = (he - hs) - (ne - ns)
    needle_depth = (ns - hs) / filler_tokens if filler_tokens > 0 else 0.0
    return PasskeyPrompt(prompt=text, input_ids=torch.tensor(ids, dtype=torch.long), answer=key,
                         n_tokens=n_tokens, length=len(ids), depth=depth, needle_depth=needle_depth,
                         needle_start=ns, needle_end=ne, haystack_start=hs, haystack_end=he,
                         seed=seed, chat=chat,
                         extra={"filler_sentences": n_units, "filler_extra_words": n_words,
                                "corpus_start": start})


def check_answer(text: str, answer: str) -> bool:
    """Whether the generated ``text`` contains the pass key ``answer``.

    A numeric key must appear as a whole number: not inside a longer run of digits. Thousands
    separators are ignored ("48,213" matches "48213"). Other keys match as a case-insensitive substring.
    """
    answer = str(answer).strip()
    if not answer:
        raise ValueError("empty answer")
    if answer.isdigit():
        normalized = re.sub(r"(?<=\d)[,\u202f\u00a0'](?=\d{3}(?!\d))", "", text)
        return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", normalized) is not None
    return answer.lower() in text.lower()


@torch.no_grad()
def run_passkey(model, tokenizer, prompt: PasskeyPrompt, max_new_tokens: int = 12,
                **generate_kwargs) -> Tuple[str, bool]:
    """Greedy generation on one passkey prompt; returns (generated text, correct).

    Extra keyword arguments go to ``model.generate`` (e.g. ``past_key_values=`` a custom cache).
    """
    device = next(model.parameters()).device
    input_ids = prompt.input_ids.reshape(1, -1).to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                  attention_mask=torch.ones_like(input_ids))
    kwargs.update(generate_kwargs)
    out = model.generate(input_ids, **kwargs)
    text = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    return text, check_answer(text, prompt.answer)


__all__ = ["PasskeyPrompt", "PromptTexts", "make_retrieval_prompt", "make_passkey_prompt", "check_answer",
           "run_passkey", "corpus_text"]
