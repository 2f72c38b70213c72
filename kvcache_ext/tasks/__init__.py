"""Evaluation tasks on long prompts (passkey retrieval)."""
from kvcache_ext.tasks.passkey import PasskeyPrompt, check_answer, make_passkey_prompt, run_passkey

__all__ = ["PasskeyPrompt", "make_passkey_prompt", "check_answer", "run_passkey"]
