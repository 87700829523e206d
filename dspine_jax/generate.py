"""Autoregressive decoding: the baseline every speedup is measured against.

``generate`` runs two jitted calls: a prefill over the (right-padded) prompts, then the whole decode
loop as one ``lax.while_loop`` with the cache donated. Prompt length, capacity and token budget are
rounded up to buckets so that similar requests reuse the compiled program. Each program is compiled
ahead of its call (``CompileTimer``), so results report compilation apart from prefill and decode.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array

from dspine_jax import drafter_io, hub, speculative
from dspine_jax import tokenizer as tokenizer_io
from dspine_jax import target as tgt
from dspine_jax.planning import (  # noqa: F401  (GenerationResult, finish_reasons, plan_request: the AR API)
    CompileTimer,
    GenerationResult,
    finish_reasons,
    max_new_tokens_cap,
    plan_request,
)
from dspine_jax.sampling import sample, validate_sampling

_log = logging.getLogger("dspine_jax")

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
    jax.config.update("jax_compilation_cache_dir", str(hub.default_cache_dir() / "jax_compilation_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def check_args(parser, args) -> None:
    """Reject bad arguments now, before the slow model load (``parser.error`` exits with status 2)."""
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens: must be a positive integer, got {args.max_new_tokens}")
    try:
        validate_sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        parser.error(f"invalid sampling parameters: {e}")
    if args.draft is None:
        for flag, value in (("--block-size", args.block_size), ("--sps-table", args.sps_table)):
            if value is not None:
                parser.error(f"{flag} sets up speculative decoding: it needs --draft")
        return
    try:
        limit = drafter_io.draft_block_size(args.draft)  # reads a checkpoint's config.json, not its weights
    except (ValueError, OSError) as e:
        parser.error(f"--draft: {e}")
    try:
        if args.block_size is not None:
            speculative.check_block_size(args.block_size, limit)
    except ValueError as e:
        parser.error(f"--block-size: {e}")
    try:
        if args.sps_table is not None:
            speculative.load_sps_table(args.sps_table)
    except (ValueError, OSError) as e:
        parser.error(f"--sps-table: {e}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspine_jax.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF-format model directory or alias (e.g. smollm2-135m-instruct)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="capped (warning) at what the context holds")
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
    check_args(parser, args)
    enable_compilation_cache()
    # transformers' "PyTorch was not found" advice is noise here: nothing in this command uses torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not _log.handlers:  # "compiling …" (CompileTimer) on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[dspine_jax] %(message)s"))
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)

    try:
        target = tgt.load_target(args.model, dtype=args.dtype)
        tok = tokenizer_io.load_tokenizer(args.model)
        prompt = encode_prompt(tok, args.prompt, args.chat)
        max_new_tokens = args.max_new_tokens
        cap = max_new_tokens_cap([len(prompt)], target.config.max_position_embeddings)
        if 1 <= cap < max_new_tokens:  # (cap < 1: the prompt itself does not fit; generate says so)
            print(f"warning: --max-new-tokens {max_new_tokens} is more than the context can hold "
                  f"({target.config.max_position_embeddings} positions, {len(prompt)}-token prompt): "
                  f"capped at {cap}", file=sys.stderr)
            max_new_tokens = cap
        sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        if args.draft:
            drafter = drafter_io.load_draft(args.draft, target)
            result = speculative.speculative_generate(target, drafter, [prompt], max_new_tokens, **sampling,
                                          block_size=args.block_size, sps_table=args.sps_table)
        else:
            result = generate(target, [prompt], max_new_tokens, **sampling)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
    except ImportError as e:  # e.g. transformers' chat templates need jinja2: say which package, no traceback
        parser.exit(1, f"error: a package this command needs is missing: {e}\n")
    tokens = result.token_ids[0]
    text = tok.decode(tokens, skip_special_tokens=True)
    if args.json:
        record = {
            "text": text, "token_ids": tokens, "num_tokens": len(tokens), "seconds": round(result.seconds, 4),
            "compile_seconds": round(result.compile_seconds, 4),
            "tokens_per_second": round(result.tokens_per_second, 2), "finish_reason": result.finish_reasons[0],
        }
        if args.draft:
            record["acceptance_lengths"] = result.acceptance_lengths[0]
            record["mean_acceptance"] = round(result.mean_acceptance, 4)
        print(json.dumps(record))
    else:
        print(text)
        print(f"[{len(tokens)} tokens in {result.seconds:.2f}s, {result.tokens_per_second:.1f} tok/s; "
              f"compilation {result.compile_seconds:.1f}s, not included; finish: {result.finish_reasons[0]}]",
              file=sys.stderr)


if __name__ == "__main__":
    main()
