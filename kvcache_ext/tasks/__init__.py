"""Evaluation tasks on long prompts: passkey and needle retrieval."""
from kvcache_ext.tasks.needle import FACTS, make_needle_prompt
from kvcache_ext.tasks.passkey import (PasskeyPrompt, PromptTexts, check_answer, make_passkey_prompt,
                                       make_retrieval_prompt, run_passkey)

__all__ = ["PasskeyPrompt", "PromptTexts", "make_passkey_prompt", "make_needle_prompt",
           "make_retrieval_prompt", "FACTS", "check_answer", "run_passkey"]
