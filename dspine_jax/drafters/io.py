"""Drafter checkpoints: load / save the z-lab DFlash and SpecForge DSpine layouts, fresh init, and the
command lines' ``--draft`` value (a checkpoint directory, a hub repo id ``ORG/NAME[@REVISION]``,
``init:KIND[:BLOCK]``, or ``self:mtp[:BLOCK]``: the target checkpoint's own MTP head, ``mtp.py``).

The backbone tensors are read and written here; each kind adds its own through its hooks
(``load_params`` / ``params_tensors`` / ``init_params`` on ``drafter.DFlash`` and subclasses), so a new
kind needs no change in this file. A checkpoint directory is ``config.json`` + ``model.safetensors`` (or a sharded index) with torch
``[out, in]`` Linear weights, names without a prefix (``fc.weight``, ``layers.0.self_attn.q_proj.weight``,
``injection.readouts.0.weight``, buffer ``transfer_codes``, SpecForge's ``transfer_ready`` flag …).
Every tensor must be consumed exactly once; anything missing, extra or mis-shaped is a
``CheckpointError`` naming the tensor.

DSpine ``transfer_codes`` (``dspine.DSpine.load_params``): used as stored when present and
``transfer_ready`` is not false; otherwise recomputed from the target's LM head (deterministic, see
``dspine.transfer_codes_from_head``). Recomputed codes
fix eigenvector signs by our own convention; a *trained* checkpoint saved without its codes may have
been trained against other signs, so ship the codes with trained weights (``save_drafter`` always does).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

# dflash2, dspark, dspine: imported to register their kinds.
from dspine_jax.drafters import dflash2, dspark, dspine, eagle3, mtp, speculators_format  # noqa: F401
from dspine_jax.drafters.config import (
    DrafterConfig,
    DrafterConfigError,
    build_target_layer_ids,
    drafter_config_from_dict,
    drafter_config_to_dict,
    drafter_kind,
    drafter_kinds,
    load_drafter_config,
)
from dspine_jax.drafters.params import (  # noqa: F401  (DRAFTER_MATRICES, pack_drafter, quantize_drafter: re-exported)
    DRAFTER_MATRICES,
    Drafter,
    DrafterLayer,
    DrafterParams,
    pack_drafter,
    quantize_drafter,
)
from dspine_jax.models import hub, panels, quant
from dspine_jax.models.target import Target, resolve_dtype
from dspine_jax.models.weights import (
    DECODER_LAYER_TENSORS,
    CheckpointError,
    check_consumed,
    load_safetensors_dir,
    strip_prefix,
    take,
)


def _layer_torch_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, n, k, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    return {
        "input_norm": (h,),
        "q": (n * d, h),
        "k": (k * d, h),
        "v": (k * d, h),
        "o": (h, n * d),
        "q_norm": (d,),
        "k_norm": (d,),
        "post_norm": (h,),
        "gate": (f, h),
        "up": (f, h),
        "down": (h, f),
    }


def check_compatible(config: DrafterConfig, target: Target) -> None:
    """A drafter reads the target's features and uses its embedding and head: widths and vocab must agree."""
    tc = target.config
    if config.hidden_size != tc.hidden_size:
        raise CheckpointError(
            f"drafter hidden_size {config.hidden_size} does not match the target's hidden_size {tc.hidden_size} "
            f"(fc.weight expects {config.num_taps}×{config.hidden_size} target features)"
        )
    if config.vocab_size != tc.vocab_size:
        raise CheckpointError(
            f"drafter vocab_size {config.vocab_size} does not match the target's vocab_size {tc.vocab_size} "
            "(the drafter decodes with the target's embedding and LM head)"
        )
    if config.num_target_layers and config.num_target_layers != tc.num_layers:
        raise CheckpointError(
            f"drafter was built for a {config.num_target_layers}-layer target; this target has {tc.num_layers} layers"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < tc.num_layers]
    if bad:
        raise CheckpointError(
            f"drafter target_layer_ids {list(config.target_layer_ids)} name layers {bad} "
            f"outside the {tc.num_layers}-layer target"
        )
    if not 0 <= config.mask_token_id < tc.vocab_size:
        raise CheckpointError(
            f"drafter mask_token_id {config.mask_token_id} is outside the target vocabulary ({tc.vocab_size})"
        )


def params_from_tensors(
    tensors: dict[str, np.ndarray], config: DrafterConfig, target: Target, dtype: jnp.dtype
) -> DrafterParams:
    """Torch-named, torch-layout tensors → ``DrafterParams``. Consumes every tensor or raises."""
    tensors = strip_prefix(tensors, ["draft_model.", "model."])
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if speculators_format.from_speculators(config):  # the verifier's embedding / head / norm: the target's here
        tensors = {k: v for k, v in tensors.items() if k not in speculators_format.VERIFIER_TENSORS}
    h, n_taps = config.hidden_size, config.num_taps

    def cast(x: np.ndarray) -> jax.Array:
        return jnp.asarray(np.asarray(x, dtype=np.float32), dtype=dtype)

    fc = take(tensors, "fc.weight", (h, n_taps * h)).T
    hidden_norm = take(tensors, "hidden_norm.weight", (h,))
    norm = take(tensors, "norm.weight", (h,))
    shapes = _layer_torch_shapes(config)
    layers = []
    for i in range(config.num_layers):
        weights = {}
        for field, suffix, transpose in DECODER_LAYER_TENSORS:
            w = take(tensors, f"layers.{i}.{suffix}", shapes[field])
            weights[field] = cast(w.T if transpose else w)
        layers.append(DrafterLayer(**weights))
    params = drafter_kind(config.kind).load_params(
        tensors, config, target, cast,
        DrafterParams(fc=cast(fc), hidden_norm=cast(hidden_norm), layers=tuple(layers), norm=cast(norm)),
    )  # fmt: skip
    if config.draft_vocab_size:
        params = attach_draft_vocab(params, draft_ids_from_tensors(tensors, config), target)
    check_consumed(tensors, f"{config.kind} drafter")
    return params


def draft_ids_from_tensors(tensors: dict[str, np.ndarray], config: DrafterConfig) -> np.ndarray:
    """EAGLE-3's draft-vocabulary tensors → target ids ``[Vd]``: ``d2t [Vd]`` offsets (draft index i is target
    token ``i + d2t[i]``) and, when present, ``t2d [V]`` (bool: the token is in the draft vocabulary), which
    must agree."""
    vd, v = config.draft_vocab_size, config.vocab_size
    ids = np.arange(vd, dtype=np.int64) + take(tensors, "d2t", (vd,)).astype(np.int64)
    check_draft_ids(ids, v)
    if "t2d" in tensors:
        member = take(tensors, "t2d", (v,)).astype(bool)
        if member.sum() != vd or not member[ids].all():
            raise CheckpointError("tensors 't2d' and 'd2t' name different draft vocabularies")
    return ids


def check_draft_ids(ids: np.ndarray, vocab: int) -> None:
    """Draft-vocabulary ids must be distinct target token ids in ascending order."""
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab or (np.diff(ids) <= 0).any():
        raise CheckpointError(f"a draft vocabulary must be distinct, ascending token ids in [0, {vocab}) (d2t)")


def attach_draft_vocab(params: DrafterParams, ids: np.ndarray, target: Target) -> DrafterParams:
    """``params`` decoding over the draft vocabulary ``ids``: the ids and the target head's columns for them."""
    ids = jnp.asarray(ids, jnp.int32)
    return params.replace(draft_ids=ids, draft_head=quant.take_columns(target.params.lm_head, ids))


def with_draft_vocab(drafter: Drafter, target: Target, ids: np.ndarray | list[int] | None) -> Drafter:
    """``drafter`` proposing only the target tokens ``ids`` (any order, duplicates dropped; EAGLE-3's reduced
    draft vocabulary), or the whole vocabulary for None / every id. The weights do not change: only which
    columns of the target's head the unary logits read. ``save_drafter`` writes ``d2t`` / ``t2d`` and
    ``draft_vocab_size``."""
    c = drafter.config
    if ids is None or len(np.unique(np.asarray(ids))) == c.vocab_size:
        config = dataclasses.replace(c, draft_vocab_size=0)
        return Drafter(params=drafter.params.replace(draft_ids=None, draft_head=None), config=config)
    ids = np.unique(np.asarray(ids, np.int64))
    check_draft_ids(ids, c.vocab_size)
    if c.top_k < c.vocab_size and len(ids) < c.top_k:
        raise ValueError(f"a draft vocabulary of {len(ids)} tokens is smaller than the drafter's {c.top_k} candidates")
    config = dataclasses.replace(c, draft_vocab_size=len(ids))
    return Drafter(params=attach_draft_vocab(drafter.params, ids, target), config=config)


def load_drafter(path: str | os.PathLike, target: Target, dtype: str | jnp.dtype | None = None) -> Drafter:
    """Load a z-lab DFlash or SpecForge DSpine checkpoint for ``target``: a directory, or a hub repo id
    ``ORG/NAME[@REVISION]`` (through the HF cache, ``hub.resolve_drafter_dir``).

    ``dtype`` defaults to the target's (the drafter shares its embedding and head)."""
    model_dir = hub.resolve_drafter_dir(path)
    try:
        config = load_drafter_config(model_dir)
    except DrafterConfigError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    check_compatible(config, target)
    dtype = _resolve_dtype(dtype, target)
    params = params_from_tensors(load_safetensors_dir(model_dir), config, target, dtype)
    return Drafter(params=params, config=config)


def drafter_to_tensors(drafter: Drafter) -> dict[str, np.ndarray]:
    """``Drafter`` → torch-named, torch-layout numpy tensors (dtype preserved, bf16 via ml_dtypes)."""
    p, c = drafter.params, drafter.config

    def host(x: jax.Array, transpose: bool = False) -> np.ndarray:
        a = np.asarray(jax.device_get(x))
        return np.ascontiguousarray(a.T if transpose else a)

    out = {"fc.weight": host(p.fc, True), "hidden_norm.weight": host(p.hidden_norm), "norm.weight": host(p.norm)}
    for i, layer in enumerate(p.layers):
        for field, suffix, transpose in DECODER_LAYER_TENSORS:
            out[f"layers.{i}.{suffix}"] = host(getattr(layer, field), transpose)
    out.update(drafter_kind(c.kind).params_tensors(p, c, host))
    if p.draft_ids is not None:  # EAGLE-3's spelling: offsets d2t and the membership mask t2d
        ids = host(p.draft_ids).astype(np.int64)
        out["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
        out["t2d"] = np.isin(np.arange(c.vocab_size), ids)
    return out


def save_drafter(drafter: Drafter, path: str | os.PathLike, format: str | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors``. ``format``: ``"native"``, the kind's reference layout
    (loadable by z-lab's ``DFlashDraftModel`` / ``DFlash2DraftModel.from_pretrained``, SpecForge's
    ``DSpineDraftModel``), or ``"speculators"``, vLLM speculators' layout (dflash, dflash2, dspark:
    ``speculators_format``); None: the kind's ``checkpoint_format`` (DSpark: speculators, else native)."""
    format = format or getattr(drafter.kind, "checkpoint_format", "native")
    if format not in ("native", "speculators"):
        raise ValueError(f"format must be 'native' or 'speculators', got {format!r}")
    tensors = drafter_to_tensors(drafter)
    if format == "speculators":
        cfg = speculators_format.nest(drafter.config)
        if drafter.params.draft_head is not None:  # speculators keeps the reduced head [Vd, H] in the file
            head = np.asarray(jax.device_get(quant.dequantize(drafter.params.draft_head)))
            tensors["lm_head.weight"] = np.ascontiguousarray(head.T)
    else:
        cfg = drafter_config_to_dict(drafter.config)
    cfg["dtype"] = "bfloat16" if drafter.dtype == jnp.bfloat16 else "float32"
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # safetensors directly rather than weights.save_safetensors: the latter's np.ascontiguousarray
    # would turn the 0-d ``transfer_ready`` flag into shape (1,), which torch's load_state_dict rejects.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def cast_drafter(drafter: Drafter, dtype: str | jnp.dtype) -> Drafter:
    """``drafter`` with its floating-point tensors in ``dtype`` (integer ones, e.g. draft-vocabulary ids, kept)."""
    dtype = resolve_dtype(dtype)

    def cast(x: jax.Array) -> jax.Array:
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return drafter.replace(params=jax.tree.map(cast, drafter.params))


def _resolve_dtype(dtype: str | jnp.dtype | None, target: Target) -> jnp.dtype:
    """``None``: the target's dtype (the drafter shares its embedding and head); else as ``load_target``."""
    return target.dtype if dtype is None else resolve_dtype(dtype)


def default_mask_token_id(target: Target, tokenizer: Any = None) -> int:
    """The mask token a *new* drafter embeds in block slots 1…B-1: a dedicated token the target never reads
    in ordinary text (z-lab / SpecForge pick one the same way; a checkpoint's own ``mask_token_id`` is
    always respected when it is loaded).

    In order: the tokenizer's mask token; else the first embedding row no token uses (``len(tokenizer) <
    vocab_size``: z-lab's Qwen3 drafters use 151669 that way); else the highest-id special token that is not
    BOS/EOS/PAD/UNK and does not occur in the chat template (SmolLM2: 16 ``<empty_output>``, a StarCoder
    notebook marker chat never produces; Llama 3: its last ``<|reserved_special_token_*|>``); else (no
    tokenizer, or no such token) the highest id that is not the target's BOS/EOS/PAD. Never the pad id by
    default: SmolLM2's pad is ``<|im_end|>`` (id 2), its end-of-turn/EOS token, which the drafter also sees
    as an anchor and in the context.
    """
    tc = target.config
    v = tc.vocab_size
    reserved = {tc.bos_token_id, tc.pad_token_id, *tc.eos_token_ids}
    if tokenizer is not None:
        mask = getattr(tokenizer, "mask_token_id", None)
        if mask is not None and 0 <= mask < v:
            return int(mask)
        size = len(tokenizer)
        if size < v:
            return size
        reserved |= {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
        template = getattr(tokenizer, "chat_template", None) or ""
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = [
            i for i, tok in decoder.items()
            if getattr(tok, "special", False) and i not in reserved and 0 <= i < v and str(tok) not in template
        ]  # fmt: skip
        if special:
            return max(special)
    return next(i for i in range(v - 1, -1, -1) if i not in reserved)


def init_drafter(
    target: Target,
    kind: str = "dspine",
    num_layers: int = 5,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    transfer_rank: int | None = None,
    message_size: int | None = None,
    top_k: int = 16,
    block_size: int = 16,
    target_layer_ids: tuple[int, ...] | list[int] | None = None,
    mask_token_id: int | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: str | jnp.dtype | None = None,
    tokenizer: Any = None,
    **kind_options: Any,
) -> Drafter:
    """A fresh drafter for ``target``, initialised the way SpecForge does.

    Backbone Linear weights ~ N(0, initializer_range) and norms = 1 (HF ``Qwen3PreTrainedModel``); DSpine
    ``message``/``receiver_gate`` keep torch's default Linear init U(±1/√R) (they are created after
    ``post_init``); ``writes``, ``predecessor_gate`` and ``bias`` are zero, so a fresh DSpine computes
    exactly a causal DFlash; readouts = the PCA directions of the transfer space.

    Defaults: heads/head_dim/intermediate/eps/rope from the target; ``target_layer_ids`` evenly spaced
    (z-lab's rule, one tap per drafter layer); ``mask_token_id`` = ``default_mask_token_id(target,
    tokenizer)`` (pass the target's tokenizer: it knows which tokens are unused);
    ``transfer_rank`` = min(1024, H, V-1); ``message_size`` = max(1, min(512, R/2)); unwindowed
    attention unless ``sliding_window`` is given (then every layer slides). DFlash in-block attention is
    bidirectional unless ``is_causal``. ``top_k`` is DSpine's / DFlash2's candidate count C; a DFlash drafter
    always decodes over the whole vocabulary (C = V). ``kind_options``: the kind's own ``init_options``
    (DFlash2: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``).
    """
    if kind not in drafter_kinds():
        raise ValueError(f"kind must be one of {', '.join(repr(k) for k in drafter_kinds())}, got {kind!r}")
    kind_impl = drafter_kind(kind)
    unknown = sorted(set(kind_options) - set(kind_impl.init_options))
    if unknown:
        raise ValueError(f"init_drafter got options {unknown} that the {kind!r} kind does not take")
    tc = target.config
    h, v = tc.hidden_size, tc.vocab_size
    ids = tuple(target_layer_ids) if target_layer_ids is not None else build_target_layer_ids(tc.num_layers, num_layers)
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(target, tokenizer)
    cfg: dict[str, Any] = {
        "architectures": [kind_impl.architecture],
        "model_type": "qwen3",
        "vocab_size": v,
        "hidden_size": h,
        "intermediate_size": intermediate_size or tc.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads or tc.num_heads,
        "num_key_value_heads": num_kv_heads or tc.num_kv_heads,
        "head_dim": head_dim or tc.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": tc.rms_norm_eps,
        "rope_parameters": {"rope_theta": tc.rope_theta, "rope_type": "default"},
        "max_position_embeddings": tc.max_position_embeddings,
        "initializer_range": initializer_range,
        "tie_word_embeddings": False,
        "layer_types": ["sliding_attention" if sliding_window else "full_attention"] * num_layers,
        "use_sliding_window": bool(sliding_window),
        "sliding_window": sliding_window,
        "block_size": block_size,
        "num_target_layers": tc.num_layers,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": list(ids)},
    }
    if is_causal is not None:
        cfg["is_causal"] = bool(is_causal)
    options = {"transfer_rank": transfer_rank, "message_size": message_size, "top_k": top_k, **kind_options}
    kind_impl.init_config(cfg, h, v, options)
    try:
        config = drafter_config_from_dict(cfg)
    except DrafterConfigError as e:
        raise ValueError(str(e)) from e
    check_compatible(config, target)
    dtype = _resolve_dtype(dtype, target)

    c = config
    nd, kd, f, L = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, c.num_layers
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * L + 8))

    def normal(shape: tuple[int, ...]) -> jax.Array:  # [in, out] layout directly
        return (initializer_range * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def ones(shape: tuple[int, ...]) -> jax.Array:
        return jnp.ones(shape, dtype)

    layers = tuple(
        DrafterLayer(
            input_norm=ones((h,)),
            q=normal((h, nd)),
            k=normal((h, kd)),
            v=normal((h, kd)),
            o=normal((nd, h)),
            q_norm=ones((c.head_dim,)),
            k_norm=ones((c.head_dim,)),
            post_norm=ones((h,)),
            gate=normal((h, f)),
            up=normal((h, f)),
            down=normal((f, h)),
        )
        for _ in range(L)
    )
    fc = normal((c.num_taps * h, h))
    backbone = DrafterParams(fc=fc, hidden_norm=ones((h,)), layers=layers, norm=ones((h,)))
    return Drafter(params=kind_impl.init_params(config, target, keys, dtype, backbone), config=config)


def copy_target_layers(drafter: Drafter, target: Target, layer_ids: tuple[int, ...] | list[int] | None = None) -> Drafter:
    """``drafter`` with its decoder layers initialised from the target's layers ``layer_ids``
    (default: the target's last L, the ones closest to next-token prediction).

    A drafter layer has the target layer's shape when heads, head dim and MLP width match (use
    ``intermediate_size`` = the target's); fused target projections are split back into q/k/v and
    gate/up. Targets without q/k norms (llama) leave the drafter's at one. Dense targets only.
    """
    c, tc = drafter.config, target.config
    layers = getattr(target.params, "layers", None)
    if layers is None or not all(hasattr(layer, "qkv") for layer in layers):
        raise ValueError("copy_target_layers needs a dense (attention-only) target")
    ids = tuple(layer_ids) if layer_ids is not None else tuple(range(tc.num_layers - c.num_layers, tc.num_layers))
    if len(ids) != c.num_layers or not all(0 <= i < tc.num_layers for i in ids):
        raise ValueError(f"need {c.num_layers} target layer ids in [0, {tc.num_layers}), got {ids}")
    mismatch = {
        name: (mine, theirs)
        for name, mine, theirs in (
            ("num_heads", c.num_heads, tc.num_heads),
            ("num_kv_heads", c.num_kv_heads, tc.num_kv_heads),
            ("head_dim", c.head_dim, tc.head_dim),
            ("intermediate_size", c.intermediate_size, tc.intermediate_size),
        )
        if mine != theirs
    }
    if mismatch:
        raise ValueError(f"drafter and target layers differ in shape (drafter, target): {mismatch}")
    nd, kd, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    dtype = drafter.params.fc.dtype

    def copied(mine: DrafterLayer, theirs: Any) -> DrafterLayer:
        cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
        theirs = panels.unpack_params(theirs)  # packed matrices (the CPU panel kernel's) as arrays
        q, k, v = jnp.split(theirs.qkv, [nd, nd + kd], axis=1)
        gate, up = jnp.split(theirs.gate_up, [f], axis=1)
        return mine.replace(
            input_norm=cast(theirs.input_norm), q=cast(q), k=cast(k), v=cast(v), o=cast(theirs.o),
            q_norm=mine.q_norm if theirs.q_norm is None else cast(theirs.q_norm),
            k_norm=mine.k_norm if theirs.k_norm is None else cast(theirs.k_norm),
            post_norm=cast(theirs.post_norm), gate=cast(gate), up=cast(up), down=cast(theirs.down),
        )  # fmt: skip

    new_layers = tuple(copied(mine, layers[i]) for mine, i in zip(drafter.params.layers, ids, strict=True))
    return drafter.replace(params=drafter.params.replace(layers=new_layers))


# ----------------------------------------------------------------------------------------------
# The command lines' --draft value


def _parse_init_draft(text: str) -> tuple[str, int] | None:
    """``init:KIND[:BLOCK]`` → (kind, block size); ``None`` for anything else (a checkpoint path)."""
    if not text.startswith("init:"):
        return None
    parts = text.split(":")
    block = parts[2] if len(parts) == 3 else "16"
    if len(parts) not in (2, 3) or parts[1] not in drafter_kinds() or not block.isdigit() or int(block) < 2:
        kinds = ", ".join(f"init:{k}" for k in drafter_kinds())
        raise ValueError(f"{text!r}: expected {kinds} or init:KIND:BLOCK (BLOCK >= 2)")
    return parts[1], int(block)


SEQUENTIAL_KINDS = (eagle3.KIND, mtp.KIND)  # heads drafting one token per step (eagle3.SequentialHead): proposers


def draft_block_size(spec: str | os.PathLike) -> int:
    """The longest verify block a ``--draft`` value stands for (a checkpoint's block size, one more for a DSpark
    drafter that samples from its anchor; ``init:KIND:BLOCK``'s BLOCK), checked without loading any weights (the
    CLI validates its arguments with it before the slow model load)."""
    text = os.fspath(spec)
    if eagle3.is_eagle3_spec(text):  # a sequential head: its block is the steps it drafts + the anchor
        return eagle3.eagle3_block_size(text)
    if mtp.is_mtp_spec(text):
        return mtp.mtp_block_size(text)
    init = _parse_init_draft(text)
    if init is not None:
        return init[1]
    if not os.path.isdir(text) and hub.parse_repo_id(text) is None:
        raise FileNotFoundError(f"{text!r} is not a directory (a drafter checkpoint), a hub repo id (ORG/NAME), "
                                "nor init:dspine / init:dflash")
    config = load_drafter_config(hub.resolve_drafter_dir(text))  # a hub id: fetched (or cached) now
    return drafter_kind(config.kind).verify_block(config)


def load_draft(
    spec: str | os.PathLike, target: Target, dtype: str | None = None, quantize: str = "none"
) -> Drafter | eagle3.Eagle3Proposer | mtp.MTPProposer:
    """A ``--draft`` CLI value → Drafter: a checkpoint directory or hub repo id (``load_drafter``), or ``init:dspine`` /
    ``init:dflash`` (optionally ``init:dspine:BLOCK``) for a fresh, untrained drafter (``init_drafter``,
    seed 0) — useful to measure engine overhead and ceilings before a trained drafter exists. ``quantize``
    as ``quantize_drafter``. A speculators eagle3 checkpoint or ``init:eagle3[:BLOCK]`` gives an
    ``Eagle3Proposer`` (``eagle3.load_eagle3_draft``), quantised and packed the same way; a speculators mtp
    checkpoint, ``self:mtp[:BLOCK]`` (the target checkpoint's own multi-token-prediction head) or
    ``init:mtp[:BLOCK]`` an ``MTPProposer`` (``mtp.load_mtp_draft``)."""
    text = os.fspath(spec)
    if eagle3.is_eagle3_spec(text):
        return eagle3.load_eagle3_draft(text, target, dtype=dtype, quantize=quantize)
    if mtp.is_mtp_spec(text):
        return mtp.load_mtp_draft(text, target, dtype=dtype, quantize=quantize)
    init = _parse_init_draft(text)
    if init is not None:
        drafter = init_drafter(target, init[0], block_size=init[1], dtype=dtype)
    else:
        drafter = load_drafter(text, target, dtype=dtype)
    return pack_drafter(quantize_drafter(drafter, quantize), target)
