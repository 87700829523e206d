"""``python -m dspine_jax.generate``: decode one prompt, autoregressively or (``--draft``) speculatively.

The decoding itself lives in ``decoding/autoregressive.py`` and ``decoding/speculative.py``; this module
only parses arguments, loads the target, tokenizer and drafter, and prints the text (or ``--json``).
``--tp`` / ``--dp`` decode on a ``data`` × ``model`` mesh; with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or ``--distributed`` on Cloud TPU) every process runs this same command, the mesh spans all
their devices, and process 0 alone prints (``dspine_jax/parallel/distributed.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence

import jax

from dspine_jax.decoding import decoder, speculative
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.planning import enable_compilation_cache, max_new_tokens_cap
from dspine_jax.drafters import io as drafter_io
from dspine_jax.models import target as tgt
from dspine_jax.models import tokenizer as tokenizer_io
from dspine_jax.models.sampling import validate_sampling
from dspine_jax.models.tokenizer import encode_prompt
from dspine_jax.parallel import distributed
from dspine_jax.parallel.mesh import make_run_mesh, use_mesh
from dspine_jax.parallel.sharding import shard_drafter, shard_target

_log = logging.getLogger("dspine_jax")


def check_args(parser, args) -> None:
    """Reject bad arguments now, before the slow model load (``parser.error`` exits with status 2)."""
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens: must be a positive integer, got {args.max_new_tokens}")
    try:
        validate_sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        parser.error(f"invalid sampling parameters: {e}")
    if args.tp < 1 or args.dp < 1:
        parser.error(f"--tp and --dp must be >= 1 (got --tp {args.tp} --dp {args.dp})")
    if (args.tp, args.dp) != (1, 1) and args.quantize != "none":
        parser.error("--quantize int8 runs on one device; drop --tp / --dp")
    distributed.check_arguments(parser, args)
    if args.draft is None:
        for flag, value in (("--verify", args.verify), ("--block-size", args.block_size), ("--sps-table", args.sps_table)):
            if value is not None:
                parser.error(f"{flag} sets up speculative decoding: it needs --draft")
        return
    try:
        limit = drafter_io.draft_block_size(args.draft)  # reads a checkpoint's config.json, not its weights
    except (ValueError, OSError) as e:
        parser.error(f"--draft: {e}")
    for flag, value in (("--verify", args.verify), ("--block-size", args.block_size)):
        try:
            verify = decoder.parse_verify(value) if value is not None else "auto"
            if verify != "auto":
                decoder.check_block_size(verify, limit)
        except ValueError as e:
            parser.error(f"{flag}: {e}")
    if args.verify not in (None, "auto") and args.block_size is not None and int(args.verify) != args.block_size:
        parser.error("--verify and --block-size both fix the verify length: give one")
    try:
        if args.sps_table is not None:
            decoder.load_sps_table(args.sps_table)
    except (ValueError, OSError) as e:
        parser.error(f"--sps-table: {e}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspine_jax.generate", description="Decode one prompt with a target model (and optionally a drafter).")
    parser.add_argument("--model", required=True,
                        help="HF-format model directory, alias (smollm2-135m-instruct) or hub repo id "
                        "ORG/NAME[@REVISION] (fetched into the HF cache; HF_HUB_OFFLINE=1 uses the cache only)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="capped (warning) at what the context holds")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantize", default="none", choices=["none", "int8"],
                        help="weight-only int8 for the target's matrices, embedding and LM head and the drafter's linear weights (--dtype: compute dtype)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="attention K/V caches (the target's and the drafter's context ring): auto = --dtype, "
                        "int8 = int8 with a float32 scale per head and token")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    parser.add_argument("--draft", help="drafter checkpoint dir or hub repo id ORG/NAME[@REVISION], init:KIND[:BLOCK] "
                        "(dspine, dflash, dflash2, dspark, eagle3, mtp: untrained) or self:mtp (the target's own MTP "
                        "head) for speculative decoding")
    parser.add_argument("--verify", help="tokens per verify step (anchor included): 'auto' (default with --draft: "
                        "chosen every round from the measured acceptance and the device's cost per length; 1 = a "
                        "plain decode step) or a fixed length N")
    parser.add_argument("--block-size", type=int, help="a fixed verify length (the older name of --verify N)")
    parser.add_argument("--sps-table", help="dynamic-verification table from python -m dspine_jax.tune")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: heads and MLP split over this many devices")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree: rows split over this many device groups "
                        "(the prompt is repeated to fill them)")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:  # before anything touches a device: the runtime must own them from the start
        distributed.initialize_from_args(args)
    except ConnectionError as e:
        parser.exit(1, f"error: {e}\n")
    leader = distributed.is_leader()
    try:  # a mesh this machine (or this set of processes) cannot build fails before the slow load
        mesh = make_run_mesh(args.tp, args.dp)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    enable_compilation_cache()
    # transformers' "PyTorch was not found" advice is noise here: nothing in this command uses torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not _log.handlers:  # "compiling …" (CompileTimer) on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[dspine_jax] %(message)s"))
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)

    # Under the multi-process runtime the collectives' own chatter must stay off stdout (the result goes there).
    quiet = distributed.stdout_to_stderr() if jax.distributed.is_initialized() else contextlib.nullcontext()
    with quiet:
        try:
            target = tgt.load_target(args.model, dtype=args.dtype, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
            tok = tokenizer_io.load_tokenizer(args.model)
            prompt = encode_prompt(tok, args.prompt, args.chat)
            max_new_tokens = args.max_new_tokens
            cap = max_new_tokens_cap([len(prompt)], target.config.max_position_embeddings)
            if 1 <= cap < max_new_tokens:  # (cap < 1: the prompt itself does not fit; generate says so)
                if leader:
                    print(f"warning: --max-new-tokens {max_new_tokens} is more than the context can hold "
                          f"({target.config.max_position_embeddings} positions, {len(prompt)}-token prompt): "
                          f"capped at {cap}", file=sys.stderr)
                max_new_tokens = cap
            sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
            drafter = drafter_io.load_draft(args.draft, target, quantize=args.quantize) if args.draft else None
            if mesh is not None:
                target = shard_target(target, mesh)
                drafter = shard_drafter(drafter, mesh) if drafter is not None else None
            # One row per data group: the rows split over ``data`` (row 0 is the answer; the copies decode alike).
            prompts = [prompt] * args.dp
            with use_mesh(mesh):
                if drafter is not None:
                    result = speculative.speculative_generate(target, drafter, prompts, max_new_tokens, **sampling,
                                                              verify=args.verify or "auto", block_size=args.block_size,
                                                              sps_table=args.sps_table)  # fmt: skip
                else:
                    result = generate(target, prompts, max_new_tokens, **sampling)
        except (ValueError, FileNotFoundError) as e:
            parser.exit(2, f"error: {e}\n")
        except ImportError as e:  # e.g. transformers' chat templates need jinja2: say which package, no traceback
            parser.exit(1, f"error: a package this command needs is missing: {e}\n")
    if leader:  # every process holds the same result; one prints it
        report(args, tok, result)


def report(args: argparse.Namespace, tok, result) -> None:
    """Print row 0 of ``result``: its text (and a timing line on stderr), or ``--json``."""
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
            record["verify_lengths"] = result.verify_lengths[0]
            record["calibration_seconds"] = round(result.calibration_seconds, 4)
        print(json.dumps(record), flush=True)
    else:
        print(text, flush=True)
        calibration = getattr(result, "calibration_seconds", 0.0)
        extra = f", verify-cost calibration {calibration:.1f}s (once)" if calibration else ""
        print(f"[{len(tokens)} tokens in {result.seconds:.2f}s, {result.tokens_per_second:.1f} tok/s; "
              f"compilation {result.compile_seconds:.1f}s{extra}, not included; finish: {result.finish_reasons[0]}]",
              file=sys.stderr)


if __name__ == "__main__":
    main()
