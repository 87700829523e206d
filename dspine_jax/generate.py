"""Autoregressive decoding: the baseline every speedup is measured against.

``generate`` runs two jitted calls: a prefill over the (right-padded) prompts, then the whole decode
loop as one ``lax.while_loop`` with the cache donated. Prompt length, capacity and token budget are
rounded up to buckets so that similar requests reuse the compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from dspine_jax import target as tgt
from dspine_jax.sampling import sample, validate_sampling

PROMPT_BUCKET = 32
CAPACITY_BUCKET = 128


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per row (a hit stop token is included)
    finish_reasons: list[str]  # per row: "stop", "length" (max_new_tokens) or "capacity"
    prefill_seconds: float
    decode_seconds: float

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def num_tokens(self) -> int:
        return sum(len(row) for row in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which prefill produces) per second of the decode loop."""
        decoded = self.num_tokens - len(self.token_ids)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def validate_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise ValueError("prompt_ids must be a non-empty list of token-id lists (one per batch row)")
    rows = []
    for i, row in enumerate(prompt_ids):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty list of token ids")
        row = [int(t) for t in row]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        rows.append(row)
    return rows


def plan_capacity(prompt_lengths: list[int], max_new_tokens: int, max_positions: int) -> int:
    """Cache slots for ``prompt + max_new_tokens``, bucketed, never above the model's positions."""
    longest = max(prompt_lengths)
    if longest >= max_positions:
        raise ValueError(
            f"prompt of {longest} tokens does not fit: the model's capacity is {max_positions} positions "
            "(at least one must remain for generation)"
        )
    return min(_round_up(longest + max_new_tokens, CAPACITY_BUCKET), max_positions)


def pad_prompts(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to a bucketed length → tokens ``[B, P]`` int32, lengths ``[B]`` int32."""
    width = _round_up(max(len(r) for r in rows), PROMPT_BUCKET)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, np.asarray([len(r) for r in rows], np.int32)


def plan_request(
    target: tgt.Target, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
    top_p: float, top_k: int, stop_ids: Sequence[int] | None,
) -> tuple[list[list[int]], int, np.ndarray, np.ndarray, list[int]]:
    """Validate a request and lay it out: rows, cache capacity, padded tokens ``[B, P]``, lengths ``[B]``
    and stop ids (``None`` → the model's EOS ids). Shared by plain and speculative decoding."""
    validate_sampling(temperature, top_p, top_k)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    config = target.config
    rows = validate_prompts(prompt_ids, config.vocab_size)
    capacity = plan_capacity([len(r) for r in rows], max_new_tokens, config.max_position_embeddings)
    tokens, lengths = pad_prompts(rows, config.pad_token_id or 0)
    stops = list(config.eos_token_ids if stop_ids is None else stop_ids)
    return rows, capacity, tokens, lengths, stops


@functools.partial(jax.jit, static_argnames=("capacity", "top_k", "greedy"))
def prefill(
    target: tgt.Target, tokens: Array, lengths: Array, key: Array, temperature: Array, top_p: Array,
    *, capacity: int, top_k: int, greedy: bool,
):
    """Prompts ``tokens [B, P]`` (right-padded to ``lengths``) → cache and the first sampled token ``[B]``."""
    cache = tgt.init_cache(target, tokens.shape[0], capacity)
    hidden, _, cache, saved = tgt.forward(target, cache, tokens, return_replay=True)
    cache = tgt.replay(cache, saved, lengths)  # a commit; on hybrids it also keeps pads out of the GDN state
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
        hidden, _, cache = tgt.forward(target, cache, last)
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

    start = time.perf_counter()
    cache, first = prefill(target, tokens, lengths, key_prefill, temp, top_p_arr, capacity=capacity, top_k=top_k, greedy=greedy)
    first.block_until_ready()
    mid = time.perf_counter()
    out, counts, stopped, _ = decode_loop(
        target, cache, first, key_decode, temp, top_p_arr, jnp.asarray(stops or [-1], jnp.int32),
        max_new_tokens=max_new_tokens, top_k=top_k, greedy=greedy,
    )
    out, counts, stopped = jax.device_get((out, counts, stopped))
    end = time.perf_counter()

    token_ids = [out[i, : counts[i]].tolist() for i in range(len(rows))]
    reasons = finish_reasons(counts, stopped, max_new_tokens)
    return GenerationResult(token_ids=token_ids, finish_reasons=reasons, prefill_seconds=mid - start, decode_seconds=end - mid)


def finish_reasons(counts: np.ndarray, stopped: np.ndarray, max_new_tokens: int) -> list[str]:
    """Why each row ended: a stop id (``stop``), the token budget (``length``), or the cache (``capacity``)."""
    return ["stop" if hit else "length" if n >= max_new_tokens else "capacity" for n, hit in zip(counts, stopped)]


# ----------------------------------------------------------------------------------------------
# CLI: python -m dspine_jax.generate --model M --prompt TEXT [...]


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for ``text``; with ``chat`` it becomes one user turn in the model's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template; this model has none")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(text, add_special_tokens=True)


def enable_compilation_cache() -> None:
    """Persist compiled programs across CLI runs (the first run of a shape compiles; later runs reuse)."""
    from dspine_jax.hub import default_cache_dir

    jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "jax_compilation_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json
    import sys

    from dspine_jax.target import load_target
    from dspine_jax.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m dspine_jax.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF-format model directory or alias (e.g. smollm2-135m-instruct)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    parser.add_argument("--draft", help="drafter checkpoint dir (or init:dspine / init:dflash) for speculative decoding")
    parser.add_argument("--block-size", type=int, help="speculative verify length (anchor included)")
    parser.add_argument("--sps-table", help="dynamic-verification table from python -m dspine_jax.tune")
    args = parser.parse_args(argv)
    enable_compilation_cache()

    try:
        target = load_target(args.model, dtype=args.dtype)
        tokenizer = load_tokenizer(args.model)
        prompt = encode_prompt(tokenizer, args.prompt, args.chat)
        sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        if args.draft:
            from dspine_jax.speculative import load_draft, speculative_generate

            drafter = load_draft(args.draft, target)
            result = speculative_generate(target, drafter, [prompt], args.max_new_tokens, **sampling,
                                          block_size=args.block_size, sps_table=args.sps_table)
        else:
            result = generate(target, [prompt], args.max_new_tokens, **sampling)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
    tokens = result.token_ids[0]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if args.json:
        record = {
            "text": text, "token_ids": tokens, "num_tokens": len(tokens), "seconds": round(result.seconds, 4),
            "tokens_per_second": round(result.tokens_per_second, 2), "finish_reason": result.finish_reasons[0],
        }
        if args.draft:
            record["acceptance_lengths"] = result.acceptance_lengths[0]
            record["mean_acceptance"] = round(result.mean_acceptance, 4)
        print(json.dumps(record))
    else:
        print(text)
        print(f"[{len(tokens)} tokens in {result.seconds:.2f}s, {result.tokens_per_second:.1f} tok/s "
              f"(includes compilation on first use); finish: {result.finish_reasons[0]}]", file=sys.stderr)


if __name__ == "__main__":
    main()
