"""``python -m dspine_jax.serve``: an OpenAI-compatible endpoint that decodes speculatively with a DSpine drafter.

Examples::

    python -m dspine_jax.serve                                   # SmolLM2-135M-Instruct + shipped drafter
    python -m dspine_jax.serve --no-speculative --port 8001      # plain autoregressive baseline
    python -m dspine_jax.serve --model /path/qwen3 --draft /path/drafter \\
        --reasoning-parser qwen3 --tool-call-parser qwen3_coder
    python -m dspine_jax.serve --model Qwen/Qwen3-8B --draft tencent/Qwen3-8B-DSpine-b16 --dtype bfloat16

The server listens at once and loads the model and compiles in the background: ``GET /health`` is 503
``{"status": "starting"}`` until then (requests get a 503 to retry), 200 ``{"status": "ok"}`` once requests
can be served — with ``--warmup lazy`` (the default) as soon as plain decoding at the smallest shapes is
compiled, while the other programs compile in the background (``/health`` and ``/metrics`` show how far).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import uvicorn

from dspine_jax.decoding.decoder import check_block_size, load_sps_table, parse_verify
from dspine_jax.decoding.planning import enable_compilation_cache
from dspine_jax.drafters.io import load_draft
from dspine_jax.models import target as tgt
from dspine_jax.models import tokenizer as tokenizer_io
from dspine_jax.parallel import distributed
from dspine_jax.parallel.mesh import make_run_mesh
from dspine_jax.serve import replica
from dspine_jax.serve.drafter_choice import DrafterEngines, parse_draft_flags
from dspine_jax.serve.engine import DEFAULT_PREFILL_CHUNK, MIN_PROMPT_BUCKET, WARMUP_MODES, EngineCore
from dspine_jax.serve.programs import DEFAULT_MAX_PROGRAMS, default_max_maps
from dspine_jax.serve.scheduler import AsyncEngine, StartupError
from dspine_jax.serve.server import ServerConfig, build_app

DEFAULT_MODEL = "smollm2-135m-instruct"
SHIPPED_DRAFTER = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-dspine-b8"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``; a computed default (None) is explained by the option's own help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):  # (computed, or said in the help)
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspine_jax.serve", description=__doc__.splitlines()[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF-format model dir, alias or hub repo id ORG/NAME[@REVISION] (through the HF cache)")
    p.add_argument("--draft", action="append", default=None, metavar="[NAME=]DIR",
                   help="drafter checkpoint dir or hub repo id, init:KIND[:BLOCK] (dspine, dflash, dflash2, dspark, "
                        "eagle3, mtp), or self:mtp (the target's own MTP head); repeat as NAME=DIR to hold several, "
                        "chosen per request by its 'drafter' field (the first is the default; an engine each) "
                        "(default: the shipped SmolLM2 DSpine drafter)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the --model value's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--max-running-requests", type=int, default=8, help="engine slots (requests decoded together)")
    p.add_argument("--rounds-per-step", type=int, default=4,
                   help="decode rounds per engine step (one device call; tokens stream in groups of this many rounds)")
    p.add_argument("--prefix-cache-mb", type=float, default=512,
                   help="device memory for finished requests' caches that later prompts sharing a prefix start from "
                        "(multi-turn chat, agents); 0 turns the prefix cache off")
    p.add_argument("--max-queued-requests", type=int, default=64, help="waiting requests beyond which 429 is returned")
    p.add_argument("--context-length", type=int, default=None,
                   help="tokens per request, prompt + completion (default: min(model positions, 2048))")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and caches")
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                        help="weight-only int8 for the target's matrices, embedding and LM head and the drafter's linear weights (--dtype: compute dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="attention K/V caches (the target's, the drafter's context ring, prefix-cache entries): "
                        "auto = --dtype, int8 = int8 with a float32 scale per head and token")
    p.add_argument("--verify", default="auto",
                   help="tokens per verify round (anchor + proposals): 'auto' (default: chosen every round from the "
                        "slots' acceptance and the measured cost per length; 1 = a plain decode step) or a fixed N")
    p.add_argument("--block-size", type=int, default=None,
                   help="a fixed verify length (the older name of --verify N)")
    p.add_argument("--sps-table", default=None,
                   help="verify length per running-batch size, from python -m dspine_jax.tune (default: none)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: heads and MLP split over this many devices")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree: slots split over this many device groups")
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding (one token per step)")
    p.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                   help="split <think> reasoning into reasoning_content (default: none)")
    p.add_argument("--tool-call-parser", choices=["qwen3_coder"], default=None,
                   help="parse tool calls from the output (default: none)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens per prefill call (rows x padded width): a longer prompt is prefilled in chunks "
                        "between decode steps of the running requests, and prompts waiting together share a call")
    p.add_argument("--warmup-prompt-buckets", type=int, default=None,
                   help="widest prefill chunk: prompts are prefilled in chunks of widths 32, 64, ... up to this "
                        "(default: --prefill-chunk)")
    p.add_argument("--warmup", default="lazy", choices=list(WARMUP_MODES),
                   help="compiling ahead: 'lazy' serves once plain decoding at the smallest shapes is compiled and "
                        "compiles the rest in the background (a drafted length not compiled yet runs as plain rounds "
                        "meanwhile); 'full' compiles every program (up to --max-programs) before /health says ok; "
                        "'none' compiles each program when a request first needs it")
    p.add_argument("--max-programs", type=int, default=DEFAULT_MAX_PROGRAMS,
                   help="compiled programs held at once (least recently used dropped beyond it; also never more than "
                        "half of the kernel's vm.max_map_count memory maps): bounds memory however many shapes traffic "
                        "touches")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    distributed.add_arguments(p)
    p.add_argument("--peer-timeout", type=int, default=replica.DEFAULT_PEER_TIMEOUT_S, metavar="SECONDS",
                   help="several processes: the longest any process waits for the others in one engine call "
                        "(compiles included) before failing every request with a 503 and exiting")
    return p


def load_engine(args: argparse.Namespace, mesh: Any, log: Callable[[str], None]) -> tuple[Any, Any]:
    """Weights, tokenizer, drafter → a compiled ``EngineCore`` and the tokenizer (the server's loader, run on
    its engine thread). Failures the user can fix raise ``StartupError`` with a one-line message."""
    t0 = time.perf_counter()
    kv = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache"
    log(f"loading {args.model} ({args.dtype}{kv}) on {jax.devices()[0].platform}")
    try:
        target = tgt.load_target(args.model, dtype=args.dtype, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
        tokenizer = tokenizer_io.load_tokenizer(args.model)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise StartupError(f"could not load model {args.model!r}: {e}") from None
    drafters = load_drafters(args, target, log)
    context = args.context_length or min(target.config.max_position_embeddings, 2048)
    if mesh is not None:
        log(f"mesh: data={args.dp} x model={args.tp} over {mesh.devices.size} {mesh.devices.flat[0].platform} devices")
    share = max(1, len(drafters))  # several drafters: an engine each, splitting the memory bounds
    cores: dict[str, EngineCore] = {}
    maps = default_max_maps()
    for name, drafter in (drafters or {None: None}).items():
        sps = load_sps_table(args.sps_table) if args.sps_table and drafter is not None else None
        try:
            core = EngineCore(target, drafter, num_slots=args.max_running_requests, context_length=context,
                              verify_len=args.block_size, sps_table=sps, mesh=mesh, verify=args.verify,
                              max_prompt_bucket=args.warmup_prompt_buckets, max_rounds=args.rounds_per_step,
                              prefill_chunk=args.prefill_chunk, max_programs=-(-args.max_programs // share),
                              max_maps=None if maps is None else maps // share,
                              prefix_cache_bytes=int(args.prefix_cache_mb * 2**20) // share)  # fmt: skip
        except ValueError as e:
            raise StartupError(str(e)) from None
        if drafter is None:
            mode = "autoregressive"
        elif core.candidates:
            mode = f"speculative, verify auto over lengths {list(core.candidates)}"
        else:
            mode = f"speculative, verify length(s) {sorted(set(core.verify_lengths.values()))}"
        which = f" [{name}]" if name is not None and len(drafters) > 1 else ""
        log(f"engine{which}: {args.max_running_requests} slots × {context} tokens, {mode}; compiling ({args.warmup} warmup)")
        core.warmup(args.warmup, progress=log)
        cores[name] = core
    core = DrafterEngines(cores) if len(cores) > 1 else next(iter(cores.values()))
    progress = core.warmup_progress()
    later = f"; {progress['pending']} more compile in the background" if progress["pending"] else ""
    log(f"ready after {time.perf_counter() - t0:.1f}s of loading and compiling ({core.program_report()['programs']} "
        f"programs{later})")
    return core, tokenizer


def load_drafters(args: argparse.Namespace, target: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """``--draft`` → ``{name: drafter}`` (empty with ``--no-speculative``; the shipped drafter by default)."""
    if args.no_speculative:
        return {}
    specs = parse_draft_flags(args.draft)
    if specs is None:
        if SHIPPED_DRAFTER.is_dir():
            specs = {"default": str(SHIPPED_DRAFTER)}
        else:
            specs = {"default": "init:dspine"}
            log(f"WARNING: no shipped drafter at {SHIPPED_DRAFTER}; using an untrained init:dspine drafter "
                "(correct output, but almost no speedup). Pass --draft DIR or --no-speculative.")
    drafters = {}
    for name, spec in specs.items():
        log(f"loading drafter {spec}" + (f" as {name!r}" if len(specs) > 1 else ""))
        try:
            drafters[name] = load_draft(spec, target, dtype=args.dtype, quantize=args.quantize)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise StartupError(f"could not load drafter {spec!r}: {e}") from None
    return drafters


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    distributed.check_arguments(parser, args)
    if args.peer_timeout < 1:
        sys.exit("error: --peer-timeout must be >= 1")
    if args.max_running_requests < 1 or args.max_queued_requests < 0:
        sys.exit("error: --max-running-requests must be >= 1 and --max-queued-requests >= 0")
    if args.prefix_cache_mb < 0:
        sys.exit("error: --prefix-cache-mb must be >= 0")
    if args.rounds_per_step < 1:
        sys.exit("error: --rounds-per-step must be >= 1")
    if args.warmup_prompt_buckets is not None and args.warmup_prompt_buckets < 1:
        sys.exit("error: --warmup-prompt-buckets must be >= 1")
    if args.max_programs < 1:
        sys.exit("error: --max-programs must be >= 1")
    if args.prefill_chunk < MIN_PROMPT_BUCKET:
        sys.exit(f"error: --prefill-chunk must be >= {MIN_PROMPT_BUCKET}")
    try:
        parse_draft_flags(args.draft)
    except ValueError as e:
        sys.exit(f"error: {e}")
    try:
        verify = parse_verify(args.verify)
        if verify != "auto":
            check_block_size(verify, None)
    except ValueError as e:
        sys.exit(f"error: --verify: {e}")

    try:  # before anything touches a device: the runtime must own them from the start
        distributed.initialize_from_args(args, heartbeat_timeout=replica.heartbeat_timeout(args.peer_timeout))
    except ConnectionError as e:
        sys.exit(f"error: {e}")
    where = f" {jax.process_index()}/{jax.process_count()}" if distributed.multiprocess() else ""

    def log(msg: str) -> None:
        print(f"[dspine_jax.serve{where}] {msg}", file=sys.stderr, flush=True)

    try:  # before loading anything: a mesh this machine cannot build should fail at once
        mesh = make_run_mesh(args.tp, args.dp)
        if mesh is not None and args.max_running_requests % args.dp:
            raise ValueError(f"--max-running-requests {args.max_running_requests} must be a multiple of --dp {args.dp}")
        if mesh is not None and args.quantize != "none":
            raise ValueError("--quantize int8 runs on one device; drop --tp / --dp")
    except ValueError as e:
        sys.exit(f"error: {e}")
    enable_compilation_cache()
    if distributed.multiprocess():
        with distributed.stdout_to_stderr():  # (gloo's chatter)
            serve_multiprocess(args, mesh, log)
        return
    engine, uv = build_server(args, lambda: load_engine(args, mesh, log), log)
    run_until_stopped(uv, engine, log)
    if engine.error is not None:
        sys.exit(f"error: {engine.error}")


def run_until_stopped(uv: uvicorn.Server, engine: AsyncEngine, log: Callable[[str], None]) -> None:
    """Serve until the engine fails or Ctrl-C / SIGTERM (uvicorn drains open requests first, then re-raises
    the interrupt: a stop asked for is a clean exit). The engine is stopped after, unless it failed."""
    try:
        uv.run()
    except KeyboardInterrupt:
        log("stopped")
    finally:
        if engine.state != "failed":
            engine.stop()


def build_server(args: argparse.Namespace, load: Callable[[], tuple[Any, Any]],
                 log: Callable[[str], None]) -> tuple[AsyncEngine, uvicorn.Server]:
    """The HTTP app over an engine thread that runs ``load`` first (not started yet), and its uvicorn server."""
    name = args.served_model_name or (args.model if not os.path.isdir(args.model) else pathlib.Path(args.model).name)
    app, engine = build_app(load, ServerConfig(
        model_name=name, reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
    ), max_queue=args.max_queued_requests)
    uv = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    engine.on_failure = lambda error: setattr(uv, "should_exit", True)  # nothing to serve: stop listening
    engine.start()
    log(f"serving {name!r} at http://{args.host}:{args.port}/v1 (POST /v1/completions, /v1/chat/completions; "
        "GET /v1/models, /health, /metrics); /health says 'starting' until the model is loaded and compiled")
    return engine, uv


def serve_multiprocess(args: argparse.Namespace, mesh: Any, log: Callable[[str], None]) -> None:
    """Process 0 serves HTTP over a ``LeaderCore``; every other process loads the same engine and follows
    (``replica.py``). Whatever ends the run, a process that lost its peers leaves with ``os._exit``: JAX's own
    shutdown would wait for the lost peers at a barrier."""
    if not distributed.is_leader():
        try:
            core, _ = load_engine(args, mesh, log)
        except StartupError as e:
            log(f"error: {e}")
            os._exit(1)
        log("following process 0")
        code = replica.follow(core, peer_timeout=args.peer_timeout, log=log)
        if code:
            os._exit(code)
        core.close()
        return
    engine: AsyncEngine | None = None

    def lost(what: str, seconds: float) -> None:  # (the watchdog's thread: the engine thread is stuck)
        engine.die(replica.PeerFailure(f"no answer from the other processes for {seconds:.0f}s ({what})"))
        threading.Timer(10.0, os._exit, (replica.FAILURE_EXIT_CODE,)).start()  # if the HTTP server lingers

    def load() -> tuple[Any, Any]:
        core, tokenizer = load_engine(args, mesh, log)
        leader = replica.LeaderCore(core, replica.Watchdog(args.peer_timeout, lost))
        engine.on_idle = leader.heartbeat
        return leader, tokenizer

    engine, uv = build_server(args, load, log)
    engine.fatal = lambda error: isinstance(error, replica.PeerFailure)
    run_until_stopped(uv, engine, log)  # (stopping the engine sends the followers ``stop``)
    if engine.error is not None:
        log(f"error: {engine.error}")
        sys.stderr.flush()
        os._exit(replica.FAILURE_EXIT_CODE)


if __name__ == "__main__":
    main()
