"""Tokenizer loading: the HF ``tokenizer.json`` beside the weights, via transformers (no hub access)."""

from __future__ import annotations

import os


def load_tokenizer(path_or_alias: str | os.PathLike):
    """A ``transformers`` tokenizer for a model directory or alias (chat template included)."""
    from transformers import AutoTokenizer

    from dspine_jax.hub import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(path_or_alias)), local_files_only=True)
