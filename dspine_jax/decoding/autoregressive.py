"""Autoregressive decoding: the baseline every speedup is measured against.

``generate`` runs two jitted calls: a prefill over the (right-padded) prompts, then the whole decode
loop as one ``lax.while_loop`` with the cache donated. Prompt length, capacity and token budget are
rounded up to buckets so that similar requests reuse the compiled program. Each program is compiled
ahead of its call (``CompileTimer``), so results report compilation apart from prefill and decode.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array

from dspine_jax.decoding.planning import CompileTimer, GenerationResult, finish_reasons, plan_request
from dspine_jax.models.sampling import sample
from dspine_jax.models import target as tgt


@functools.partial(jax.jit, static_argnames=("capacity", "top_k", "greedy"))
def prefill(
    target: tgt.Target, tokens: Array, lengths: Array, key: Array, temperature: Array, top_p: Array,
    *, capacity: int, top_k: int, greedy: bool,
):
    """Prompts ``tokens [B, P]`` (right-padded to ``lengths``) → cache and the first sampled token ``[B]``."""
    cache = tgt.init_cache(target, tokens.shape[0], capacity)
    hidden, _, cache, saved = tgt.forward(target, cache, tokens)
    cache = tgt.replay(target, cache, saved, lengths)  # a commit; on hybrids it also keeps pads out of the GDN state
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    return cache, sample(key, tgt.lm_logits(target, last), temperature, top_p, top_k, greedy)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k", "greedy"), donate_argnames=("cache",))
def decode_loop(
    target: tgt.Target, cache, first_token: Array, key: Array, temperature: Array, top_p: Array, stop_ids: Array,
    *, max_new_tokens: int, top_k: int, greedy: bool,
):
    """Decode until every row stops. Returns tokens ``[B, max_new_tokens]``, counts ``[B]``, stopped ``[B]``
    and the final cache (returned so the donated input buffers are reused in place).

    Row ``b`` holds ``counts[b]`` valid tokens; ``stopped[b]`` says it ended on a stop id.
    """
    batch = first_token.shape[0]
    out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first_token)
    stopped = jnp.isin(first_token, stop_ids)
    counts = jnp.ones((batch,), jnp.int32)
    # A row may emit one token per free cache slot (the last one is returned, never fed back).
    budget = jnp.minimum(max_new_tokens, cache.capacity - cache.lengths + 1)

    def active(counts: Array, stopped: Array) -> Array:
        return ~stopped & (counts < budget)

    def cond(state):
        _, counts, stopped, _, _ = state
        return jnp.any(active(counts, stopped))

    def body(state):
        cache, counts, stopped, out, key = state
        key, step_key = jax.random.split(key)
        running = active(counts, stopped)
        last = jnp.take_along_axis(out, (counts - 1)[:, None], axis=1)  # [B, 1]
        hidden, _, cache, _ = tgt.forward(target, cache, last)
        cache = cache.commit(running.astype(jnp.int32))
        token = sample(step_key, tgt.lm_logits(target, hidden[:, 0]), temperature, top_p, top_k, greedy)
        out = out.at[jnp.arange(batch), counts].set(jnp.where(running, token, 0), mode="drop")
        stopped = stopped | (running & jnp.isin(token, stop_ids))
        return cache, counts + running, stopped, out, key

    cache, counts, stopped, out, _ = jax.lax.while_loop(cond, body, (cache, counts, stopped, out, key))
    return out, counts, stopped, cache


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
    request = plan_request(target, prompt_ids, max_new_tokens, temperature, top_p, top_k, stop_ids)
    rows, capacity, tokens, lengths, stops = request
    greedy = temperature == 0
    key_prefill, key_decode = jax.random.split(jax.random.key(seed))
    temp, top_p_arr = jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p)

    clock = CompileTimer()
    (cache, first), prefill_seconds = clock.run(
        prefill, target, tokens, lengths, key_prefill, temp, top_p_arr, capacity=capacity, top_k=top_k, greedy=greedy
    )
    # Compiled once prefill has run, for the real cache: an abstract stand-in for it (eval_shape /
    # out_info) differs in layout details and makes the timed call compile again.
    (out, counts, stopped, _), decode_seconds = clock.run(
        decode_loop, target, cache, first, key_decode, temp, top_p_arr, jnp.asarray(stops or [-1], jnp.int32),
        max_new_tokens=max_new_tokens, top_k=top_k, greedy=greedy,
    )
    out, counts, stopped = jax.device_get((out, counts, stopped))

    token_ids = [out[i, : counts[i]].tolist() for i in range(len(rows))]
    return GenerationResult(
        token_ids=token_ids, finish_reasons=finish_reasons(counts, stopped, max_new_tokens),
        prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, compile_seconds=clock.seconds,
    )
