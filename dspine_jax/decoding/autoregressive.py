"""Autoregressive decoding: the baseline every speedup is measured against.

``generate`` is the speculative decoder with nothing drafted: a ``NoProposer`` (``block_limit`` 1), so
every round is a plain decode step (``T = 1``: one token through the target, argmax or a sample). It runs
the same two programs as ``speculative_generate`` — a prefill over the (right-padded) prompts, then the
whole decode loop as one device call with the cache donated — so plain and speculative decoding share
every line that decides a token, a budget or a stop. Prompt length, capacity and token budget are rounded
up to buckets so that similar requests reuse the compiled programs.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspine_jax.decoding.planning import GenerationResult
from dspine_jax.decoding.proposers import NoProposer
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.models import target as tgt


def generate(
    target: tgt.Target,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` per row. ``stop_ids=None`` uses the model's EOS ids; ``[]`` none."""
    result = speculative_generate(target, NoProposer(), prompt_ids, max_new_tokens, temperature=temperature,
                                  top_p=top_p, top_k=top_k, seed=seed, stop_ids=stop_ids)  # fmt: skip
    return GenerationResult(
        token_ids=result.token_ids, finish_reasons=result.finish_reasons, prefill_seconds=result.prefill_seconds,
        decode_seconds=result.decode_seconds, compile_seconds=result.compile_seconds,
    )
