"""Tokenizer loading: the HF ``tokenizer.json`` beside the weights, via transformers (no hub access)."""

from __future__ import annotations

import os

from dspine_jax import hub


def load_tokenizer(path_or_alias: str | os.PathLike):
    """A ``transformers`` tokenizer for a model directory or alias (chat template included).

    transformers is imported here, not at the top: it takes seconds and only tokenizing needs it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hub.resolve_model_dir(path_or_alias)), local_files_only=True)
