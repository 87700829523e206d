"""Lower every program a user's run compiles, for TPU and GPU, on a machine that has neither.

    python -m dspine_jax.lower --target qwen3-8b --draft init:dspine-b16 --platforms tpu,cuda --batch 1,8
    python -m dspine_jax.lower --target qwen3.5-27b --draft init:dspine-b16 --tp 4 --dp 2 --json

Why: everything this package ever ran ran on a CPU, where the Pallas kernels run interpreted and the
dispatcher picks the XLA reference. A TPU or GPU user's first run would be the first time anyone learned
whether the kernels lower (Mosaic's (8, 128) tiling, Triton's power-of-two blocks), whether a jitted
round holds a host callback, or whether the sharded programs partition. ``jax.export`` lowers for
platforms the machine does not have, from ``ShapeDtypeStruct``s, so all of that is checked here.

How:

* The target and the drafter are built with **abstract weights**: the family's own loader (or the
  drafter's initialiser) runs under ``jax.eval_shape`` over abstract tensors — the safetensors headers
  of a local checkpoint, or, for a shape preset (``models/presets.py``) or a hub id (only its
  ``config.json`` is fetched), the names and shapes of transformers' model built on the ``meta`` device.
  No weight is read and no memory is allocated.
* Each program — generate's prefill, the serving engine's prefill chunk, the AR decode loop, the
  speculative round (``decoder.segment``) at each verify length ``adaptive.candidate_lengths``
  can pick, the greedy peek, and the serving engine's step at each length and as a peek — is lowered
  with ``jax.export.export(jax.jit(f), platforms=[p])`` inside ``dispatch.lowering_for(p)``, so the kernels
  take the Pallas backend of ``p`` (Mosaic TPU / Triton), never the reference.
* A row per program × platform × batch: lowered or the first line of the error, the Mosaic
  (``tpu_custom_call``) and Triton custom calls in the lowered StableHLO, any host callback (an error),
  and FLOPs / bytes from XLA's HLO cost analysis. The cost comes from the **same program lowered for the
  CPU with the kernels' XLA reference path** (``jax.jit(f).lower(...).cost_analysis()``): XLA cannot
  cost a Mosaic/Triton custom call, and the reference computes what the kernel computes. HLO cost
  analysis counts a ``while`` body once, so a loop program's cost is one iteration's (one round, one
  decode step) plus what surrounds the loop.

Exit status 1 if any program fails to lower, holds a host callback, or drafts without a Pallas kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from huggingface_hub import hf_hub_download
from jax import export
from jax.sharding import NamedSharding
from safetensors import safe_open

from dspine_jax.decoding import adaptive, decoder, speculative
from dspine_jax.decoding import round as rnd
from dspine_jax.decoding.proposers import NoProposer, Proposer, as_proposer
from dspine_jax.drafters import io as drafter_io
from dspine_jax.drafters import speculators_format
from dspine_jax.drafters.config import drafter_kinds
from dspine_jax.drafters.params import Drafter
from dspine_jax.models import dense, hub, hybrid, presets, weights
from dspine_jax.models import target as tgt
from dspine_jax.models.config import read_config_json
from dspine_jax.models.family import family_for, target_config_from_dict
from dspine_jax.models.sampling import Sampling
from dspine_jax.pallas import dispatch
from dspine_jax.parallel import sharding
from dspine_jax.parallel.mesh import logical_spec, make_mesh, use_mesh
from dspine_jax.serve import engine

PLATFORMS = ("tpu", "cuda", "rocm")
# The custom-call target of a Pallas Triton kernel in a lowered module (jax 0.10: ``__gpu$xla.gpu.triton``).
TRITON_TARGET = "__gpu$xla.gpu.triton"
MOSAIC_TARGET = "tpu_custom_call"
# Host callbacks (jax.pure_callback / io_callback / debug.print) lower to these custom calls; a decode
# program holding one would stall the device on the host every round, and cannot run on a TPU pod at all.
CALLBACK_MARKERS = ("callback", "python")
COST_SOURCE = ("XLA HLO cost analysis of the same program lowered for CPU with the kernels' XLA reference "
               "path (while-loop bodies counted once)")
ENGINE_ROUNDS = 4  # the engine's default --rounds-per-step
_SHARDED = re.compile(r'sdy\.sharding<@\w+, \[[^>]*"\w+"|mhlo\.sharding = "\{devices=\[')
_CUSTOM_CALL = re.compile(r'(?:stablehlo\.custom_call\s+@|call_target_name\s*=\s*")([^\s("]+)')


def spec(shape: Sequence[int], dtype: Any, sharding_: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding_)


def abstract(tree: Any) -> Any:
    """Every array leaf of ``tree`` (concrete, e.g. a policy built on the host) as a ``ShapeDtypeStruct``:
    the exported programs take shapes, never values."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


# ----------------------------------------------------------------------------------------------
# Abstract weights


class _TraceableNumpy:
    """``numpy`` for the loaders while they run under ``jax.eval_shape``: ``concatenate`` / ``asarray`` /
    ``stack`` of traced arrays go to ``jax.numpy`` (the loaders' only NumPy calls that would force a
    tracer to a host array), everything else — and every call on real NumPy arrays, such as a draft
    vocabulary's integer ids — is NumPy itself."""

    _TRACEABLE = ("concatenate", "asarray", "stack")

    def __getattr__(self, name: str) -> Any:
        real = getattr(np, name)
        if name not in self._TRACEABLE:
            return real
        jax_fn = getattr(jnp, name)

        def call(first: Any, *args: Any, **kwargs: Any) -> Any:
            items = first if isinstance(first, (list, tuple)) else [first]
            if any(isinstance(x, jax.Array) for x in items):
                return jax_fn(first, *args, **kwargs)
            return real(first, *args, **kwargs)

        return call


@contextlib.contextmanager
def _traceable_loaders() -> Iterator[None]:
    """The loader modules see ``_TraceableNumpy`` as ``np`` for the duration (restored afterwards)."""
    modules = (dense, hybrid, weights, drafter_io)
    saved = [m.np for m in modules]
    shim = _TraceableNumpy()
    try:
        for m in modules:
            m.np = shim
        yield
    finally:
        for m, original in zip(modules, saved):
            m.np = original


_INT_DTYPES = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL"}


def safetensors_specs(model_dir: Path) -> dict[str, Any]:
    """``{name: ShapeDtypeStruct}`` from a checkpoint's safetensors headers (no float data read; integer
    tensors — a draft vocabulary's ``d2t``/``t2d`` — are read, they decide values, not shapes)."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = [model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    out: dict[str, Any] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                piece = f.get_slice(name)
                if piece.get_dtype() in _INT_DTYPES:
                    out[name] = f.get_tensor(name)
                else:
                    out[name] = spec(piece.get_shape(), jnp.float32)
    return out


def meta_specs(cfg: dict[str, Any]) -> dict[str, Any]:
    """``{name: ShapeDtypeStruct}`` of a config's HF checkpoint: transformers' causal LM built on torch's
    ``meta`` device (names and shapes, no memory). Needs torch (the test extra)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise RuntimeError(f"a shape preset or hub id needs torch for its tensor names ({e}); "
                           "pip install torch, or pass a local checkpoint directory") from e
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    hf_config = AutoConfig.for_model(cfg["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: spec(tuple(t.shape), jnp.float32) for name, t in model.state_dict().items()}


def _abstract_eval(build: Callable[..., Any], tensors: dict[str, Any], *extra: Any) -> Any:
    """``build(tensors, *extra)`` under ``jax.eval_shape``: traced tensors for the abstract ones, real
    NumPy for the integer ones."""
    concrete = {k: v for k, v in tensors.items() if isinstance(v, np.ndarray)}
    traced = {k: v for k, v in tensors.items() if not isinstance(v, np.ndarray)}
    with _traceable_loaders():
        return jax.eval_shape(lambda t, *e: build({**t, **concrete}, *e), traced, *extra)


def _target_source(name: str) -> tuple[dict[str, Any], Path | None, str]:
    """A ``--target`` → (config.json dict, local checkpoint dir or None, description)."""
    cfg = presets.preset_config(name)
    if cfg is not None:
        return cfg, None, f"preset {name}"
    if not os.path.isdir(name) and hub.parse_repo_id(name) is not None:  # a hub id: only its config.json
        repo, _, revision = name.partition("@")
        path = hf_hub_download(repo, "config.json", revision=revision or None)
        return json.loads(Path(path).read_text()), None, f"hub {name} (config only)"
    model_dir = Path(hub.resolve_model_dir(name))  # a directory or an alias (or a clear one-line error)
    return read_config_json(model_dir), model_dir, str(model_dir)


def abstract_target(name: str, dtype: str = "bfloat16", kv_cache_dtype: str = "auto") -> tgt.Target:
    """A ``Target`` whose params are ``ShapeDtypeStruct``s, from a preset, a checkpoint dir, an alias or a
    hub id (config only): the family's own loader under ``jax.eval_shape``."""
    cfg, model_dir, where = _target_source(name)
    config = target_config_from_dict(cfg)
    family = family_for(config.model_type)
    tensors = safetensors_specs(model_dir) if model_dir is not None and _has_weights(model_dir) else meta_specs(cfg)
    params = _abstract_eval(lambda t: family.params_from_hf(t, config, tgt.resolve_dtype(dtype)), tensors)
    return tgt.with_kv_cache_dtype(tgt.Target(params=params, config=config, model_dir=where), kv_cache_dtype)


def _has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file()


_INIT_SHORT = re.compile(r"^init:([A-Za-z0-9_]+)-b(\d+)$")


def normalise_draft(text: str) -> str:
    """``init:KIND-bBLOCK`` (``init:dspine-b16``) → ``load_draft``'s ``init:KIND:BLOCK``; else unchanged."""
    m = _INIT_SHORT.match(text)
    if m is None:
        return text
    kinds = (*drafter_kinds(), *drafter_io.SEQUENTIAL_KINDS)
    if m.group(1) not in kinds or int(m.group(2)) < 2:
        raise ValueError(f"{text!r}: expected init:KIND-bBLOCK with KIND one of {', '.join(kinds)} and BLOCK >= 2")
    return f"init:{m.group(1)}:{m.group(2)}"


def abstract_drafter(draft: str, target: tgt.Target) -> Drafter | Proposer:
    """A ``Drafter`` (or a sequential head's proposer: EAGLE-3, MTP) with ``ShapeDtypeStruct`` params for
    ``target``: ``init:…`` and ``self:mtp`` run the initialiser or loader under ``jax.eval_shape``; a block
    drafter's checkpoint (dir or hub id) its loader over the safetensors headers."""
    text = normalise_draft(draft)
    if text.startswith(("init:", "self:")) or speculators_format.spec_model_type(text) in drafter_io.SEQUENTIAL_KINDS:
        return jax.eval_shape(lambda t: drafter_io.load_draft(text, t), target)
    model_dir = Path(hub.resolve_drafter_dir(text))
    config = drafter_io.load_drafter_config(model_dir)
    drafter_io.check_compatible(config, target)

    def build(tensors: dict[str, Any], t: tgt.Target) -> Drafter:
        return Drafter(params=drafter_io.params_from_tensors(tensors, config, t, t.dtype), config=config)

    return _abstract_eval(build, safetensors_specs(model_dir), target)


def shard_abstract(tree: Any, place: Callable[[Any], Any], mesh: Any) -> Any:
    """``place(tree)`` (``sharding.shard_target`` / ``shard_drafter``) on abstract weights: the layout
    (fused projections regrouped per model shard) is traced under ``jax.eval_shape``, and each weight gets
    the ``NamedSharding`` that ``sharding.place`` gives it (recorded as it places each weight, in the
    order the pytree flattens; checked shape by shape)."""
    recorded: list[tuple[tuple[int, ...], NamedSharding]] = []

    def put(value: Any, axes: tuple[str | None, ...] | None, mesh_: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(put(v, axes, mesh_) for v in value)
        if not isinstance(value, jax.Array):
            return value
        where = NamedSharding(mesh_, logical_spec(value.shape, axes or (None,) * value.ndim, dict(mesh_.shape)))
        recorded.append((tuple(value.shape), where))
        return value

    original = sharding._put
    sharding._put = put
    try:
        out = jax.eval_shape(place, tree)
    finally:
        sharding._put = original
    leaves, treedef = jax.tree.flatten(out)
    if [tuple(x.shape) for x in leaves] != [shape for shape, _ in recorded]:
        raise RuntimeError("abstract sharding: the placed weights do not follow the pytree's order")
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
                                        for x, (_, where) in zip(leaves, recorded)])


# ----------------------------------------------------------------------------------------------
# Programs


@dataclasses.dataclass
class Program:
    """A program a run compiles: ``fn(*args)`` (static arguments bound), ``drafts``: it runs a block drafter's
    forward, so it must hold the Pallas kernels when lowered for an accelerator (a sequential head's attention
    is XLA's)."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    drafts: bool = False


@dataclasses.dataclass
class Setup:
    batch: int = 1
    context: int = 2048  # planned cache capacity (tokens per row)
    prompt: int = 256  # prefill width (the engine's default --prefill-chunk)
    max_new_tokens: int = 256


def _key_spec(*lead: int) -> jax.ShapeDtypeStruct:
    return spec((*lead, *jax.random.key_data(jax.random.key(0)).shape), jnp.uint32)


def build_programs(target: tgt.Target, drafter: Drafter | Proposer, setup: Setup, mesh: Any = None,
                   only: Sequence[str] | None = None) -> list[Program]:
    """Every program of ``generate``, ``speculative_generate`` (``verify="auto"``) and the serving engine
    for ``setup.batch`` rows, as ``Program``s over abstract arguments. ``only``: name prefixes to keep."""
    proposer = as_proposer(drafter)
    kernels = isinstance(drafter, Drafter)  # (block drafters attend through the Pallas draft kernels)
    candidates = adaptive.candidate_lengths(proposer.block_limit)
    t_max = max(candidates)
    b, w = setup.batch, setup.prompt
    capacity = setup.context + t_max  # speculative_generate's slack for the widest verify block
    out_width = speculative.round_up(setup.max_new_tokens, speculative.TOKEN_BUCKET)
    f32, i32 = jnp.float32, jnp.int32
    stop_ids = spec((speculative.STOP_BUCKET,), i32)
    programs: list[Program] = []

    def want(name: str) -> bool:
        return only is None or any(name.startswith(o) for o in only)

    def prefill(target, proposer, tokens, lengths, key_data, temperature, top_p):
        return rnd.prefill(target, proposer, tokens, lengths, jax.random.wrap_key_data(key_data), temperature, top_p,
                           capacity=capacity, top_k=0, greedy=True)  # fmt: skip

    prefill_args = (target, proposer, spec((b, w), i32), spec((b,), i32), _key_spec(), spec((), f32), spec((), f32))
    with use_mesh(mesh):
        cache, pstate, first = jax.eval_shape(prefill, *prefill_args)
    if want("prefill"):
        programs.append(Program("prefill", prefill, prefill_args, drafts=False))

    # The serving engine's prefill chunk (``prefill_rows``) into rows sized like ``refit`` makes them.
    if want("prefill_chunk"):
        chunk_args = (target, proposer, cache, pstate, spec((b, w), i32), spec((b,), i32), _key_spec(b),
                      spec((b,), f32), spec((b,), f32), spec((b,), i32))
        programs.append(Program("prefill_chunk", engine.prefill_rows, chunk_args))

    def begin(cache, pstate, first, key_data, stop_ids, max_new, *, max_verify):
        sampling = Sampling.rows(first.shape[0], jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
        return speculative.begin_impl(cache, pstate, first, jax.random.wrap_key_data(key_data), sampling, stop_ids,
                                      max_new, max_verify=max_verify, out_width=out_width)  # fmt: skip

    if want("ar_decode"):  # generate: the decoder with nothing drafted, plain rounds to the end
        plain = NoProposer()

        def ar_prefill(target, tokens, lengths, key_data):
            return rnd.prefill(target, plain, tokens, lengths, jax.random.wrap_key_data(key_data), jnp.float32(1.0),
                               jnp.float32(1.0), capacity=setup.context + 1, top_k=0, greedy=True)  # fmt: skip

        with use_mesh(mesh):
            ar_cache, _, ar_first = jax.eval_shape(ar_prefill, target, spec((b, w), i32), spec((b,), i32), _key_spec())
            ar_state, ar_out = jax.eval_shape(functools.partial(begin, max_verify=1), ar_cache, None, ar_first,
                                              _key_spec(), stop_ids, spec((), i32))  # fmt: skip
        fn = functools.partial(decoder.segment, verify_len=1, greedy=True)
        programs.append(Program("ar_decode", fn, (target, plain, ar_state, ar_out, stop_ids, spec((), i32),
                                                  abstract(adaptive.fixed_policy(1)))))

    # speculative_generate(verify="auto"): the rows' state, then one segment program per (length, peek).
    with use_mesh(mesh):
        state, transcript = jax.eval_shape(functools.partial(begin, max_verify=t_max), cache, pstate, first,
                                           _key_spec(), stop_ids, spec((), i32))  # fmt: skip
    policy = abstract(adaptive.make_policy(candidates, dict.fromkeys(candidates, 1.0)))
    for t, peek in adaptive.programs(candidates, greedy_probes=True):
        name = "peek" if peek else f"round_T{t}"
        if want(name):
            fn = functools.partial(decoder.segment, verify_len=t, greedy=True, peek=peek)
            programs.append(Program(name, fn, (target, proposer, state, transcript, stop_ids, spec((), i32), policy,
                                               spec((), i32), spec((), jnp.bool_)),
                                    drafts=kernels and (peek or t > 1)))  # fmt: skip

    # The serving engine's step (``serve/engine.py::step``) at each length and as a peek, over R = batch slots
    # (its state: the same rows' state as above).
    for t, peek in adaptive.programs(candidates, greedy_probes=True):
        name = "step_peek" if peek else f"step_T{t}"
        if want(name):
            fn = functools.partial(engine.step, verify_len=t, max_rounds=ENGINE_ROUNDS, peek=peek)
            programs.append(Program(name, fn, (target, proposer, state, stop_ids, spec((), i32), policy),
                                    drafts=kernels and (peek or t > 1)))
    return programs


# ----------------------------------------------------------------------------------------------
# Lowering and reporting


@dataclasses.dataclass
class Row:
    program: str
    platform: str
    batch: int
    lowered: bool
    error: str | None = None
    mosaic_kernels: int = 0
    triton_kernels: int = 0
    host_callbacks: list[str] = dataclasses.field(default_factory=list)
    custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    sharded_values: int = 0  # sharding annotations naming a mesh axis (Shardy) or a device tiling (GSPMD)
    flops: float | None = None
    bytes_accessed: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.lowered and not self.host_callbacks and self.error is None


def custom_calls(text: str) -> dict[str, int]:
    """``{custom-call target: count}`` in a lowered module's text."""
    counts: dict[str, int] = {}
    for name in _CUSTOM_CALL.findall(text):
        counts[name] = counts.get(name, 0) + 1
    return counts


def export_program(program: Program, platform: str, mesh: Any = None) -> export.Exported:
    """``program`` exported for ``platform`` with the dispatcher lowering its kernels for that platform.
    Raises whatever lowering raises (Mosaic's block-shape checks included)."""
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_TARGET)] if platform in ("cuda", "rocm") else []
    with dispatch.lowering_for(platform), use_mesh(mesh):
        return export.export(jax.jit(program.fn), platforms=[platform], disabled_checks=checks)(*program.args)


def program_cost(program: Program, mesh: Any = None) -> tuple[float | None, float | None]:
    """(FLOPs, bytes accessed) of ``program`` per ``COST_SOURCE`` (None where XLA does not say)."""
    with dispatch.force("reference"), use_mesh(mesh):
        analysis = jax.jit(program.fn).lower(*program.args).cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    flops, moved = analysis.get("flops"), analysis.get("bytes accessed")
    return (None if flops is None else float(flops)), (None if moved is None else float(moved))


def lower_program(program: Program, platform: str, batch: int, mesh: Any = None) -> Row:
    """One row: lower ``program`` for ``platform`` and inspect the module (never raises for a lowering
    error: it is the row's ``error``)."""
    begin = time.perf_counter()
    try:
        text = export_program(program, platform, mesh).mlir_module()
    except Exception as e:  # noqa: BLE001  (every lowering failure is a reported row, not a crash)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        # jax.export refuses custom calls without a compatibility guarantee, host callbacks among them: name them.
        callbacks = sorted({m for m in re.findall(r"[\w$.]+", str(e)) if any(k in m.lower() for k in CALLBACK_MARKERS)
                            and "custom_call" not in m.lower()})
        return Row(program.name, platform, batch, lowered=False, error=f"{type(e).__name__}: {first}"[:400],
                   host_callbacks=callbacks, seconds=time.perf_counter() - begin)
    calls = custom_calls(text)
    callbacks = sorted(n for n in calls if any(m in n.lower() for m in CALLBACK_MARKERS))
    mosaic = calls.get(MOSAIC_TARGET, 0)
    triton = sum(c for n, c in calls.items() if "triton" in n.lower())
    row = Row(program.name, platform, batch, lowered=True, mosaic_kernels=mosaic, triton_kernels=triton,
              host_callbacks=callbacks, custom_calls=calls, sharded_values=len(_SHARDED.findall(text)),
              seconds=time.perf_counter() - begin)
    if program.drafts and mosaic + triton == 0:
        row.error = "no Pallas kernel in a drafting program (the dispatcher fell back to the XLA reference)"
    elif callbacks:
        row.error = f"host callback(s) {', '.join(callbacks)}"
    return row


def lower_all(target: tgt.Target, drafter: Drafter | Proposer, platforms: Sequence[str], batches: Sequence[int],
              setup: Setup, mesh: Any = None, cost: bool = True, only: Sequence[str] | None = None,
              log: Callable[[str], None] | None = None) -> list[Row]:
    """Rows for every program × platform × batch size (cost analysed once per program and batch)."""
    rows: list[Row] = []
    for batch in batches:
        programs = build_programs(target, drafter, dataclasses.replace(setup, batch=batch), mesh, only)
        for program in programs:
            flops = moved = None
            if cost:
                try:
                    flops, moved = program_cost(program, mesh)
                except Exception as e:  # noqa: BLE001  (a cost failure is reported, not fatal)
                    if log:
                        log(f"cost analysis of {program.name} failed: {type(e).__name__}: {e}")
            for platform in platforms:
                row = lower_program(program, platform, batch, mesh)
                row.flops, row.bytes_accessed = flops, moved
                rows.append(row)
                if log:
                    log(format_row(row))
    return rows


def _si(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_row(row: Row) -> str:
    status = "lowered" if row.lowered and row.ok else ("FAILED: " + (row.error or ""))
    return (f"{row.program:<14} {row.platform:<5} B={row.batch:<3} {status:<60.60} mosaic={row.mosaic_kernels:<3} "
            f"triton={row.triton_kernels:<3} callbacks={len(row.host_callbacks)} flops={_si(row.flops):>8} "
            f"bytes={_si(row.bytes_accessed):>8} {row.seconds:5.1f}s")


# ----------------------------------------------------------------------------------------------
# CLI


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --{what} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: --{what} takes integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dspine_jax.lower", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True,
                    help=f"preset ({', '.join(presets.preset_names())}), checkpoint dir, alias or hub id")
    ap.add_argument("--draft", default="init:dspine-b16", help="checkpoint dir / hub id, or init:KIND-bBLOCK")
    ap.add_argument("--platforms", default="tpu,cuda")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--context", type=int, default=2048, help="planned cache capacity per row")
    ap.add_argument("--prompt", type=int, default=256, help="prefill width (chunk)")
    ap.add_argument("--programs", default=None, help="comma-separated program-name prefixes to lower (default all)")
    ap.add_argument("--no-cost", action="store_true", help="skip XLA cost analysis")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    platforms = [p.strip().lower() for p in args.platforms.split(",") if p.strip()]
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        ap.error(f"--platforms takes some of {', '.join(PLATFORMS)}, got {args.platforms!r}")
    args.platform_list = platforms
    args.batches = _ints(args.batch, "batch")
    if args.tp < 1 or args.dp < 1:
        ap.error("--tp and --dp must be >= 1")
    if any(b % args.dp for b in args.batches):
        ap.error(f"every --batch must be a multiple of --dp {args.dp}")
    return args


def run(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build the abstract models, lower everything, return the report (also what ``--json`` prints)."""
    mesh = None
    if args.tp * args.dp > 1:
        # The mesh of CPU devices stands in for the accelerator's: the lowered programs are partitioned for
        # tp × dp devices of the platform lowered for (the devices' own kind does not enter the module).
        mesh = make_mesh(tp=args.tp, dp=args.dp, devices=jax.devices("cpu"))
    begin = time.perf_counter()
    target = abstract_target(args.target, args.dtype, args.kv_cache_dtype)
    drafter = abstract_drafter(args.draft, target)
    if mesh is not None:
        target = shard_abstract(target, functools.partial(sharding.shard_target, mesh=mesh), mesh)
        drafter = shard_abstract(drafter, functools.partial(sharding.shard_drafter, mesh=mesh), mesh)
    build_seconds = time.perf_counter() - begin
    only = None if args.programs is None else [p.strip() for p in args.programs.split(",") if p.strip()]
    setup = Setup(context=args.context, prompt=args.prompt)
    rows = lower_all(target, drafter, args.platform_list, args.batches, setup, mesh, cost=not args.no_cost,
                     only=only, log=log)
    return {
        "target": args.target, "target_config": target.model_dir, "model_type": target.config.model_type,
        "draft": args.draft, "block_size": as_proposer(drafter).block_limit,
        "verify_lengths": list(adaptive.candidate_lengths(as_proposer(drafter).block_limit)),
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "tp": args.tp, "dp": args.dp,
        "context": args.context, "prompt": args.prompt, "engine_rounds_per_step": ENGINE_ROUNDS,
        "jax": jax.__version__, "cost_source": COST_SOURCE, "build_seconds": build_seconds,
        "seconds": time.perf_counter() - begin, "ok": all(r.ok for r in rows) and bool(rows),
        "rows": [dataclasses.asdict(r) | {"ok": r.ok} for r in rows],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    need = args.tp * args.dp
    if need > len(jax.devices()) and jax.default_backend() == "cpu" and argv is None and "_DSPINE_LOWER_REEXEC" not in os.environ:
        # JAX's CPU backend is up (importing the package starts it) with too few devices for the mesh: run
        # again with that many host devices (the flag only counts before the backend starts).
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={need}".strip()
        env = {**os.environ, "XLA_FLAGS": flags, "_DSPINE_LOWER_REEXEC": "1"}
        os.execve(sys.executable, [sys.executable, "-m", "dspine_jax.lower", *sys.argv[1:]], env)
    log = None if args.json else (lambda line: print(line, flush=True))
    if log:
        log(f"lowering {args.target} + {args.draft} for {','.join(args.platform_list)} at batch "
            f"{','.join(map(str, args.batches))} (tp {args.tp}, dp {args.dp}, kv {args.kv_cache_dtype}); "
            f"cost: {COST_SOURCE}")
    try:
        report = run(args, log)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        failed = [r for r in report["rows"] if not r["ok"]]
        print(f"{len(report['rows']) - len(failed)}/{len(report['rows'])} programs lowered cleanly "
              f"in {report['seconds']:.0f}s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
