"""Tokenizer loading: the HF ``tokenizer.json`` beside the weights, via transformers (the directory comes from
``hub.resolve_model_dir``; transformers itself never contacts a hub)."""

from __future__ import annotations

import os

from dspine_jax.models import hub


def load_tokenizer(path_or_alias: str | os.PathLike):
    """A ``transformers`` tokenizer for a model directory, alias or hub repo id (chat template included).

    transformers is imported here, not at the top: it takes seconds and only tokenizing needs it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hub.resolve_model_dir(path_or_alias)), local_files_only=True)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for ``text``; with ``chat`` it becomes one user turn in the model's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template; this model has none")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(text, add_special_tokens=True)
