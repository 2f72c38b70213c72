"""RULER-style synthetic tasks, generated offline (Hsieh et al., 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?").

Eleven of RULER's thirteen tasks: the eight needle variants (``niah.VARIANTS``), variable
tracking (``vt``), common-words (``cwe``) and frequent-words (``fwe``) extraction. RULER's two
QA tasks need SQuAD and HotpotQA, which are not shipped. Each prompt is generated from a seed
and the model's tokenizer at a length in tokens, and scored as RULER scores it: the share of
the expected answers found in the output (``string_match_all``), 0 to 100 over the prompts.

    p = make_ruler_prompt(tokenizer, "niah_multikey_1", 4096, seed=0)
    p.input_ids, p.answers, p.haystack_end    # the question starts at haystack_end
    p.score(" 3336625.")                       # 0.0 to 1.0

How ours differs from RULER's generator is in docs/evaluation.md ("RULER-style tasks").
"""
from __future__ import annotations

from kvcache_ext.tasks.passkey import uses_chat
from kvcache_ext.tasks.ruler.niah import VARIANTS, make_niah_prompt
from kvcache_ext.tasks.ruler.prompt import RulerPrompt, string_match_all
from kvcache_ext.tasks.ruler.variable_tracking import make_variable_tracking_prompt
from kvcache_ext.tasks.ruler.word_extraction import make_common_words_prompt, make_frequent_words_prompt

MAKERS = {**{name: make_niah_prompt for name in VARIANTS}, "vt": make_variable_tracking_prompt,
          "cwe": make_common_words_prompt, "fwe": make_frequent_words_prompt}
TASKS = tuple(MAKERS)


def make_ruler_prompt(tokenizer, task: str, n_tokens: int, seed: int = 0, chat: bool | None = None) -> RulerPrompt:
    """A prompt of RULER task ``task`` (one of ``TASKS``) of ``n_tokens`` tokens or a few fewer;
    in the tokenizer's chat template when ``chat`` (``None``: when it has one)."""
    if task not in MAKERS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer; got {n_tokens!r}")
    return MAKERS[task](tokenizer, task, n_tokens, seed=seed, chat=uses_chat(tokenizer, chat))


__all__ = ["TASKS", "RulerPrompt", "make_ruler_prompt", "string_match_all"]
