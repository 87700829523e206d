"""Drafters: the draft context cache, the backbone every kind shares, the kind registry's base ``DFlash``.

A drafter *kind* is a registered class (``drafter_config.register_drafter_kind``) named by
``config.kind``; ``drafter.kind`` is its instance and the functions below dispatch to it. ``DFlash``
here is the base; ``DSpine(DFlash)`` (``dspine.py``) adds the injection, last-write refinement and the
transition walk; ``DFlash2(DFlash)`` (``dflash2.py``) wraps each sublayer in dynamic causal convolutions
and walks a candidate selector. A kind overrides ``around_sublayer`` (how a layer runs its attention and
MLP), ``after_layer`` (what runs after each backbone layer), the decode head
(``candidates`` → scores, ``select`` → proposals) and, for weights of its own, the checkpoint hooks.
Training runs the same ``forward_blocks`` over many anchored blocks with its own attention
(``train/model.py``).

Drafting API (what the speculative loop calls)
==============================================

The drafter reads the target's tapped hidden states of *committed* tokens through a per-row context
cache, and drafts a whole block in one forward::

    cache = init_draft_cache(drafter, batch, capacity)                  # empty, lengths = 0
    cache = append_context(drafter, cache, tapped, num_new)             # tapped [n, B, T, H], num_new [B]
    out   = draft(drafter, target, cache, anchor, keys, sampling)       # anchor [B] int32, keys [B], Sampling
    out.tokens   [B, P]     int32    proposals for block slots 1…P (P = block_size - 1)
    out.cand_ids [B, P, C]  int32    the candidates each proposal was drawn from
    out.q        [B, P, C]  float32  draft distribution over those candidates (zero mass elsewhere;
                                     one-hot on the proposal at temperature 0) — lossless verification
                                     needs q(token) and the residual max(0, p - q) over the vocabulary,
                                     see ``q_full``.

* ``tapped`` is ``target.forward(..., taps=drafter.config.target_layer_ids)[1]`` for the tokens being
  committed, in tap order; ``num_new[b]`` of its ``T`` columns are real (the rest is padding).
* **Invariant**: the anchor (last committed token, the previous round's bonus) sits at position
  ``cache.lengths[b]``; the context holds the target features of positions ``0 … lengths-1``. So after
  prefill append the prompt's features (``num_new`` = prompt length, anchor = first sampled token);
  after a round append the verify pass's features of the anchor and the accepted proposals
  (``num_new`` = accepted + 1; the bonus becomes the next anchor). There is no separate start
  position argument: it is ``cache.lengths``.
* ``draft`` is pure and static-shaped: ``jax.jit(draft)(drafter, target, cache, anchor, keys, sampling)`` is
  the whole round-draft (backbone, injection, top-K, transition table, walk) as one compiled call.
  ``keys [B]`` are per-row PRNG keys and ``sampling`` a ``Sampling`` of per-row ``[B]`` arrays (temperature,
  top-p, top-k), all traced: a row with temperature ``<= 0`` is greedy, so one compilation serves greedy
  and sampled rows in the same batch.
* DFlash: in-block attention as configured (bidirectional by default), no injection, each slot
  decoded independently from its own logits; C = vocab size (``cand_ids`` is ``arange(V)``), so ``q`` is
  ``sampling.sampling_probs(logits, temperature, top_p, top_k)``: the target's own sampling transform,
  exactly as z-lab's ``dflash_generate`` builds its draft distribution.
* DSpine (``dspine.py``): causal in-block attention, injection after every layer, C = ``top_k`` candidates from the
  unary logits (the drafter config's ``top_k``, not the sampling one), last-write refinement (LWR) table
  ``[B, P, C, C]`` and a left-to-right ``lax.scan`` over table look-ups; at temperature > 0 slot i samples
  from ``softmax(T[i, k_prev, :] / temperature)`` (top-p / top-k sampling filters do not apply: the walk
  is already restricted to the C candidates, like z-lab's DFlash2 ``propose``).
* DFlash2 (``dflash2.py``): DFlash's attention, each sublayer wrapped in grouped dynamic causal
  convolutions along the block (``around_sublayer``), C = ``selector_top_k`` candidates and a selector
  table ``[B, P, C, C]`` (unary + codebook transition) walked like DSpine's; q as DSpine's.
* Any kind may carry a **draft vocabulary** (``config.draft_vocab_size`` = Vd > 0, EAGLE-3's reduced head,
  ``io.with_draft_vocab``): ``unary_logits`` reads only the target head's columns ``draft_ids [Vd]``, its
  last axis indexes those ids (``vocab_ids`` maps back), so candidates, proposals and q's support lie in the
  vocabulary (a DFlash drafter's C is then Vd). Verification is unchanged: output stays exact / lossless.

Draft context cache
===================

``DraftCache.k/v`` (L × ``[B, K, S, D]``, heads-major) hold, per drafter layer, the context keys (after
``k_norm`` and RoPE at their absolute positions) and values computed from ``ctx = hidden_norm(fc(concat(taps)))``.
It is a **ring buffer**: position ``p`` lives in slot ``p mod S``; slot positions are derived from
``lengths`` (no stored positions), and a slot whose position is negative is empty. ``S`` is the capacity; when every
layer has a sliding window ``W`` the ring only needs ``W - 1`` slots (the anchor at ``start`` sees
``start-W+1 …``), which is what ``init_draft_cache`` allocates, so an 8192-window drafter costs 8191 slots
however long the sequence. With unwindowed layers the capacity must cover the whole sequence; if it
does not, the ring silently acts as a window of ``S`` (keys older than ``S`` are overwritten).
With ``kv_cache_dtype="int8"`` (the target's, passed by ``DrafterProposer.init``) each layer's ring is a
``cache.Int8KV`` (int8 + a float32 scale per row, head and slot), quantised in ``append_context`` and
dequantised per layer just before draft attention (the Pallas kernels read float rings).

Everything here is functional. Parameters are ``[in, out]`` (torch checkpoints are ``[out, in]``;
drafter_io.py transposes). Letters follow layers.py: B batch, T block, S key slots, H, N/K heads, D,
F, V, L layers, C candidates, R transfer rank, M message width; P = T - 1 proposal slots.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.models.sampling import Sampling, categorical_rows, process_rows, split_rows
from dspine_jax.drafters.config import DrafterConfig, drafter_kind, register_drafter_kind
from dspine_jax.models.cache import (
    LENGTHS_AXES, Int8KV, dequantize_kv, kv_zeros, quantize_kv, resize_slots, sharded_zeros,
)
from dspine_jax.models import quant
from dspine_jax.models.layers import apply_rope, rms_norm, rope_cos_sin, swiglu
from dspine_jax.models.target import Target, lm_logits
from dspine_jax.parallel.mesh import per_device, weight
from dspine_jax.pallas import draft_attention as _attention_kernel

# ----------------------------------------------------------------------------------------------
# Parameters


@struct.dataclass
class DrafterLayer:
    """One backbone layer's weights. Layers are kept as a tuple, not stacked: the layer loop is unrolled
    and each layer reads its own buffers (slicing a stacked weight makes XLA:CPU copy it)."""

    input_norm: Array  # [H]
    q: Array = weight(None, "heads", group="attention")  # [H, N*D]
    k: Array = weight(None, "kv_heads", group="attention")  # [H, K*D]
    v: Array = weight(None, "kv_heads", group="attention")  # [H, K*D]
    o: Array = weight("heads", None, group="attention")  # [N*D, H]
    q_norm: Array = weight()  # [D]
    k_norm: Array = weight()  # [D]
    post_norm: Array = weight()  # [H]
    gate: Array = weight(None, "mlp")  # [H, F]
    up: Array = weight(None, "mlp")  # [H, F]
    down: Array = weight("mlp", None)  # [F, H]

    def for_mesh(self, config: DrafterConfig, model_shards: int) -> tuple[DrafterLayer, dict[str, bool]]:
        """Heads split over ``model_shards`` only when query and KV heads both divide (all or none)."""
        split = config.num_heads % model_shards == 0 and config.num_kv_heads % model_shards == 0
        return self, {"attention": split}


@struct.dataclass
class DrafterParams:
    """The backbone every kind shares, plus DSpine's injection (``dspine.Injection``) and transfer codes.
    A kind with other weights of its own subclasses this (its loader and initialiser build it)."""

    fc: Array  # [n_taps*H, H]
    hidden_norm: Array  # [H]
    layers: tuple[DrafterLayer, ...]  # L layers
    norm: Array  # [H]
    injection: Any = None  # dspine.Injection (DSpine only)
    transfer_codes: Array | None = None  # [V, R] DSpine only; fixed, derived from the target's LM head
    # Draft vocabulary (config.draft_vocab_size > 0): its target ids [Vd] int32, ascending, and the target LM
    # head's columns for them [H, Vd] (derived from the target at load, like the codes; never trained or saved).
    draft_ids: Array | None = None
    draft_head: Any = None  # Array or quant.Int8Weight, as the target's head


@struct.dataclass
class Drafter:
    """A drafter: params (pytree) + static config. Pass it straight into ``jax.jit``."""

    params: DrafterParams
    config: DrafterConfig = struct.field(pytree_node=False)

    @property
    def kind(self) -> DFlash:
        """The registered kind (``config.kind``) whose methods run this drafter."""
        return drafter_kind(self.config.kind)

    @property
    def dtype(self) -> jnp.dtype:
        return self.params.fc.dtype


@struct.dataclass
class DraftCache:
    """Per drafter layer, the committed context's K/V in a ring of ``S`` slots (see module doc).

    Heads-major ``[B, K, S, D]`` per layer (a tuple, one buffer per layer) because that is the layout
    both attention products consume: any other layout makes XLA transpose (copy) the whole context at
    every draft, and a stacked ``[L, …]`` array would be sliced (copied) per layer.
    """

    k: tuple[Array | Int8KV, ...]  # L × [B, K, S, D] after k_norm + RoPE
    v: tuple[Array | Int8KV, ...]  # L × [B, K, S, D]
    lengths: Array  # [B] int32: context tokens committed so far = position of the next anchor

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


@struct.dataclass
class BlockForward:
    hidden: Array  # [B, T, H] after the final norm (unary logits come from here); [B, A, T, H] in training
    pre_injection: Array  # [B, T, H] last layer's output before its injection (LWR restarts here)
    features: Array | None = None  # [L, B, A, T, R] post-injection readout features, when asked for (DSpine)


@struct.dataclass
class DraftOutput:
    tokens: Array  # [B, P] int32 proposals for block slots 1..P
    cand_ids: Array  # [B, P, C] int32
    q: Array  # [B, P, C] float32, rows sum to 1


@struct.dataclass
class Candidates:
    """What a kind's decode head chooses among: ``cand_ids [B, P, C]`` and their ``scores`` — unary logits
    ``[B, P, C]`` (DFlash) or a transition table ``[B, P, C, C]`` conditioned on the predecessor (DSpine)."""

    cand_ids: Array
    scores: Array


class Replacement(NamedTuple):
    """Training's predecessor replacement (teacher forcing): in the first ``layers`` layers, blocks with
    ``mask [B, A]`` set take the true predecessor's code ``codes [B, A, P, R]`` as their message."""

    mask: Array
    codes: Array
    layers: int


# ``attend(layer, q [B, T', N, D], k [B, T', K, D], v [B, T', K, D]) → [B, T', N, D]``: the block's queries
# against whatever context the caller keeps (the ring cache at inference, the whole sequence in training)
# and against the block's own keys. T' = A·T when A blocks run side by side.
Attend = Callable[[int, Array, Array, Array], Array]
# ``choose(scores [B, C], keys [B]) → (index [B], q [B, C])``: one slot's pick and the distribution it drew from.
Choose = Callable[[Array, Array], tuple[Array, Array]]
# ``wrap(sublayer, x [B, T', H], run) → [B, T', H]``: how one layer runs its "attention" or "mlp" sublayer
# ``run`` on its normed input ``x`` (the kind's ``around_sublayer``, bound to a layer and block length).
Wrap = Callable[[str, Array, Callable[[Array], Array]], Array]


# ----------------------------------------------------------------------------------------------
# Draft context cache


def ring_slots(drafter: Drafter, capacity: int) -> int:
    """Ring slots for rows of up to ``capacity`` positions: ``capacity``, capped at ``max(window) - 1``
    when every layer is windowed."""
    windows = drafter.config.layer_windows
    return min(capacity, max(max(windows) - 1, 1)) if all(w > 0 for w in windows) else capacity


def init_draft_cache(drafter: Drafter, batch: int, capacity: int, kv_cache_dtype: str = "auto") -> DraftCache:
    """An empty ring for ``batch`` rows. ``capacity`` = the longest sequence (prompt + generated) a row
    will reach; with every layer windowed the ring is capped at ``max(window) - 1`` slots.
    ``kv_cache_dtype``: "auto" (the drafter's dtype) or "int8" (``Int8KV`` per layer)."""
    config = drafter.config
    slots = ring_slots(drafter, capacity)
    shape = (batch, config.num_kv_heads, slots, config.head_dim)
    zeros = tuple(kv_zeros(shape, drafter.dtype, kv_cache_dtype) for _ in range(config.num_layers))
    return DraftCache(k=zeros, v=zeros, lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES))


def resize_ring(drafter: Drafter, cache: DraftCache, capacity: int) -> DraftCache:
    """The ring for rows of up to ``capacity`` positions. Valid while every row's positions are below
    both slot counts: a ring that never wrapped holds position ``p`` in slot ``p``."""
    slots = ring_slots(drafter, capacity)
    if slots == cache.capacity:
        return cache
    fit = lambda x: resize_slots(x, slots)  # noqa: E731
    return cache.replace(k=tuple(map(fit, cache.k)), v=tuple(map(fit, cache.v)))


def context_slot_positions(cache: DraftCache) -> Array:
    """Absolute position held by each ring slot ``[B, S]`` (negative = empty): the latest p < lengths
    with p ≡ slot (mod S)."""
    return _attention_kernel.ring_positions(cache.lengths, cache.capacity)


def fuse_context(drafter: Drafter, tapped: Array) -> Array:
    """``tapped [n, B, T, H]`` (tap order) → ``ctx = hidden_norm(fc(concat)) [B, T, H]``.

    Concatenation order is tap order along H, like z-lab's ``extract_context_feature``."""
    n, b, t, h = tapped.shape
    if n != drafter.config.num_taps or h != drafter.config.hidden_size:
        raise ValueError(
            f"tapped features have shape {tapped.shape}; the drafter expects "
            f"[{drafter.config.num_taps}, B, T, {drafter.config.hidden_size}]"
        )
    concat = jnp.transpose(tapped, (1, 2, 0, 3)).reshape(b, t, n * h).astype(drafter.dtype)
    return rms_norm(concat @ drafter.params.fc, drafter.params.hidden_norm, drafter.config.rms_norm_eps)


def context_kv(drafter: Drafter, layer: int, ctx: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """One layer's context keys (k_norm, RoPE) and values from ``ctx [B, S, H]`` → ``[B, S, K, D]`` each.
    ``ctx`` does not pass through ``input_layernorm``."""
    config, lp = drafter.config, drafter.params.layers[layer]
    b, s, _ = ctx.shape
    kh, d = config.num_kv_heads, config.head_dim
    k = apply_rope(rms_norm((ctx @ lp.k).reshape(b, s, kh, d), lp.k_norm, config.rms_norm_eps), cos, sin)
    return k, (ctx @ lp.v).reshape(b, s, kh, d)


def append_context(drafter: Drafter, cache: DraftCache, tapped: Array, num_new: Array) -> DraftCache:
    """Commit ``num_new [B]`` (≤ T) tokens' target features ``tapped [n, B, T, H]`` at positions
    ``lengths … lengths+num_new-1``: every layer's context K/V into the ring, then ``lengths += num_new``.

    Context K/V depend only on ``ctx`` and each layer's own k/v projections, so every layer's are
    computed here, once, rather than inside the draft forward. Only the last ``S`` of a row's new tokens
    are written (a long prompt into a short window ring), so no two writes of one call hit the same slot.
    """
    b, _, s, d = cache.k[0].shape
    t = tapped.shape[2]
    ctx = fuse_context(drafter, tapped)  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
    cos, sin = rope_cos_sin(positions, d, drafter.config.rope_theta, ctx.dtype)  # [B, T, D]
    num_new = num_new.astype(jnp.int32)
    offset = jnp.arange(t)[None, :]
    keep = (offset < num_new[:, None]) & (offset >= num_new[:, None] - s)  # [B, T]
    slots = jnp.where(keep, jnp.mod(positions, s), s)  # slot s is out of range → dropped
    rows = jnp.arange(b)[:, None]

    def put(ring: Array | Int8KV, x: Array) -> Array | Int8KV:  # x [B, T, K, D] into slots [B, T] of every head
        # A scatter along S of the heads-major buffer: in place (no cache-sized copy) for f32 on
        # XLA:CPU and on accelerators. (XLA:CPU converts a bf16 buffer to f32 around a scatter.)
        if isinstance(ring, Int8KV):
            q, scale = quantize_kv(x)  # per row, token and head: [B, T, K, D], [B, T, K, 1]
            return Int8KV(q=put(ring.q, q), scale=put(ring.scale, scale))
        return ring.at[rows, :, slots].set(x, mode="drop")

    new_k, new_v = [], []
    for layer, (cache_k, cache_v) in enumerate(zip(cache.k, cache.v)):
        k, v = context_kv(drafter, layer, ctx, cos, sin)  # [B, T, K, D]
        new_k.append(put(cache_k, k))
        new_v.append(put(cache_v, v))
    return cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)


# ----------------------------------------------------------------------------------------------
# Backbone


def block_tokens(drafter: Drafter, anchor: Array) -> Array:
    """``[anchor, MASK × (T-1)]`` → ``[B, T]`` int32 (``anchor [B]``; any leading axes work)."""
    t = drafter.config.block_size
    mask = jnp.full((*anchor.shape, t - 1), drafter.config.mask_token_id, jnp.int32)
    return jnp.concatenate([anchor.astype(jnp.int32)[..., None], mask], axis=-1)


def embed_block(drafter: Drafter, embed: Array, tokens: Array) -> Array:
    """Block tokens ``[..., T]`` → ``[..., T, H]`` through the target's own input embedding ``[V, H]``."""
    x = embed[tokens].astype(drafter.dtype)
    if drafter.config.input_embedding_scale != 1.0:
        x = x * drafter.config.input_embedding_scale
    return x


def backbone_layer(
    drafter: Drafter, layer: int, x: Array, cos: Array, sin: Array, attend: Attend, wrap: Wrap | None = None
) -> Array:
    """One decoder layer on ``x [B, T', H]`` with RoPE tables ``[B, T', D]`` of the block positions: queries
    from the block, keys/values from the block and whatever context ``attend`` brings. ``wrap`` runs each
    sublayer on its normed input (default: the sublayer alone)."""
    config = drafter.config
    lp = drafter.params.layers[layer]
    b, t, _ = x.shape
    n, kh, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps

    def attention(normed: Array) -> Array:
        q = apply_rope(rms_norm((normed @ lp.q).reshape(b, t, n, d), lp.q_norm, eps), cos, sin)
        k = apply_rope(rms_norm((normed @ lp.k).reshape(b, t, kh, d), lp.k_norm, eps), cos, sin)
        v = (normed @ lp.v).reshape(b, t, kh, d)
        return attend(layer, q, k, v).reshape(b, t, n * d) @ lp.o

    def mlp(normed: Array) -> Array:
        return swiglu(normed, lp.gate, lp.up, lp.down)

    wrap = wrap or (lambda sublayer, normed, run: run(normed))
    x = x + wrap("attention", rms_norm(x, lp.input_norm, eps), attention)
    return x + wrap("mlp", rms_norm(x, lp.post_norm, eps), mlp)


def cache_attention(drafter: Drafter, cache: DraftCache) -> Attend:
    """Inference attention: the block against the ring cache's context and causally/bidirectionally
    inside itself (one block per row)."""
    config = drafter.config
    # Kernel dispatch (kernels/pallas/dispatch.py, at trace time): the jnp reference, or the Pallas kernel with
    # the same semantics (tiles skipped, not masked). Under a mesh each device attends its own rows and heads
    # (query heads split together with their KV heads).
    heads, kv_heads, ctx = ("batch", None, "heads", None), ("batch", None, "kv_heads", None), ("batch", "kv_heads", None, None)

    def attend(layer: int, q: Array, k: Array, v: Array) -> Array:
        attention = per_device(
            functools.partial(_attention_kernel.draft_attention, window=config.layer_windows[layer], causal=config.layer_causal[layer]),
            [heads, ctx, ctx, kv_heads, kv_heads, ("batch",)], heads,
        )  # fmt: skip
        # An int8 ring is dequantised here, one layer at a time: both attention paths read float rings.
        ctx_k, ctx_v = dequantize_kv(cache.k[layer], drafter.dtype), dequantize_kv(cache.v[layer], drafter.dtype)
        return attention(q, ctx_k, ctx_v, k, v, cache.lengths)

    return attend


def unary_logits(drafter: Drafter, target: Target, hidden: Array) -> Array:
    """``hidden [..., H]`` → float32 logits over the drafter's vocabulary ``[..., V]`` (``[..., Vd]`` with a
    draft vocabulary: index i is token ``draft_ids[i]``, see ``vocab_ids``) with z-lab's optional multiplier /
    soft-cap."""
    config = drafter.config
    head = drafter.params.draft_head
    logits = lm_logits(target, hidden) if head is None else quant.matmul_f32(hidden, head)
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    if config.final_logit_softcapping > 0:
        cap = config.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


def vocab_ids(drafter: Drafter, index: Array) -> Array:
    """Indices into ``unary_logits``' last axis → target token ids (the identity without a draft vocabulary)."""
    ids = drafter.params.draft_ids
    return index if ids is None else jnp.take(ids, index)


def choose(scores: Array, keys: Array, temperature: Array) -> tuple[Array, Array]:
    """Pick one candidate per row of ``scores [B, C]`` with the row's own key and temperature (``[B]``):
    argmax where ``temperature <= 0``, else a sample from ``softmax(scores / temperature)``. Returns index
    ``[B]`` and the distribution used ``[B, C]`` (one-hot for greedy rows)."""
    greedy = temperature <= 0
    scaled = scores / jnp.where(greedy, 1.0, temperature)[:, None]
    best = jnp.argmax(scores, axis=-1)
    index = jnp.where(greedy, best, categorical_rows(keys, scaled))
    q = jnp.where(greedy[:, None], jax.nn.one_hot(best, scores.shape[-1], dtype=jnp.float32), jax.nn.softmax(scaled, axis=-1))
    return index.astype(jnp.int32), q


def top_candidates(logits: Array, count: int) -> tuple[Array, Array]:
    """The ``count`` best of ``logits [B, P, V]`` → scores, ids ``[B, P, C]`` (best first)."""
    scores, cand_ids = jax.lax.top_k(logits, count)
    # The barrier stops XLA from folding top_k's index output into the gathers that follow, which
    # turns top_k into a full sort of [B, P, V] on CPU (measured: 294 ms → 64 ms per draft).
    return scores, jax.lax.optimization_barrier(cand_ids.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------
# Drafter kinds


@register_drafter_kind
class DFlash:
    """The DFlash kind (z-lab): the backbone, then each slot decoded independently from its own logits.

    Kinds are stateless classes registered by name (``config.kind``); ``drafter.kind`` is the instance.
    A subclass overrides the hooks below — ``around_sublayer`` (how a layer runs its attention / MLP),
    ``after_layer`` (what runs after each backbone layer),
    ``candidates`` / ``select`` / ``decode`` (the decode head), and the checkpoint hooks
    (``configure``, ``write_config``, ``load_params``, ``params_tensors``, ``init_config``, ``init_params``;
    ``init_options`` names the extra ``init_drafter`` arguments ``init_config`` reads) — and registers
    itself; nothing else in the package names a kind.
    """

    name = "dflash"
    architecture = "DFlashDraftModel"  # config.json ``architectures`` entry of this kind's checkpoints
    config_section: str | None = None  # a config.json key whose presence marks this kind's checkpoints
    injects = False  # whether ``after_layer`` changes the stream (``inject=False`` runs the backbone alone)
    init_options: tuple[str, ...] = ()  # kind-specific keyword arguments ``init_drafter`` accepts

    # --- config.json (the fields beyond the Qwen3 backbone and dflash_config) ---

    def configure(self, cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Kind-specific ``DrafterConfig`` fields from ``cfg`` on top of the parsed backbone ``fields``.
        DFlash decodes over the whole vocabulary (C = V)."""
        return {**fields, "top_k": fields["vocab_size"]}

    def write_config(self, config: DrafterConfig, cfg: dict[str, Any]) -> None:
        """Write the kind's keys into the ``config.json`` dict ``cfg``. DFlash: ``is_causal`` only when the
        per-layer default (sliding ⇒ causal) would not reproduce the configured causality."""
        default = tuple(w > 0 for w in config.layer_windows)
        if config.layer_causal == default:
            cfg.pop("is_causal", None)
            return
        if len(set(config.layer_causal)) != 1:
            raise ValueError("per-layer causality that is neither uniform nor the layer-type default cannot be saved")
        cfg["is_causal"] = config.layer_causal[0]

    def init_config(self, cfg: dict[str, Any], hidden: int, vocab: int, options: dict[str, Any]) -> None:
        """Add a fresh drafter's kind keys to its ``config.json`` dict (``options``: ``init_drafter``'s
        kind arguments ``transfer_rank``, ``message_size``, ``top_k``)."""

    # --- weights ---

    def load_params(self, tensors: dict, config: DrafterConfig, target: Target, cast: Callable, backbone: DrafterParams) -> DrafterParams:
        """The kind's own tensors (popped from ``tensors``, torch layout) on top of the loaded backbone."""
        return backbone

    def params_tensors(self, params: DrafterParams, config: DrafterConfig, host: Callable) -> dict[str, Any]:
        """The kind's own tensors, torch names and layout (``host(x, transpose)`` makes numpy)."""
        return {}

    def init_params(self, config: DrafterConfig, target: Target, keys: Any, dtype: jnp.dtype, backbone: DrafterParams) -> DrafterParams:
        """Fresh kind weights on top of the initialised backbone (``keys``: an iterator of PRNG keys)."""
        return backbone

    # --- forward ---

    def around_sublayer(
        self, drafter: Drafter, layer: int, sublayer: str, x: Array, run: Callable[[Array], Array], *, block: int
    ) -> Array:
        """How backbone layer ``layer`` runs its ``sublayer`` ("attention" or "mlp") ``run`` on the normed
        input ``x [B, A·T, H]`` (``A`` blocks of ``block`` positions, block-major); the result is added to the
        residual stream. DFlash: the sublayer alone."""
        return run(x)

    def after_layer(self, drafter: Drafter, layer: int, h: Array, anchor: Array, replacement: Replacement | None) -> Array:
        """What runs on ``h [B, A, T, H]`` after backbone layer ``layer`` (``anchor [B, A]``). DFlash: nothing."""
        return h

    def layer_feature(self, drafter: Drafter, layer: int, h: Array) -> Array | None:
        """The per-layer feature training aligns (``[B, A, T, R]``), or None for kinds without one."""
        return None

    def replacement(self, drafter: Drafter, mask: Array, labels: Array) -> Replacement | None:
        """Training's predecessor replacement for the blocks ``mask [B, A]`` selects, whose real tokens are
        ``labels [B, A, T]`` (None for kinds without predecessor messages)."""
        return None

    def forward_blocks(
        self, drafter: Drafter, x: Array, cos: Array, sin: Array, attend: Attend, anchor: Array,
        *, inject: bool = True, replacement: Replacement | None = None, collect_features: bool = False,
    ) -> BlockForward:
        """The drafter forward over ``A`` blocks per row, shared by inference (A = 1, context from the ring
        cache) and training (many anchored blocks against the whole sequence).

        ``x [B, A, T, H]`` embedded blocks, ``cos/sin [B, A·T, D]`` RoPE of their positions, ``anchor
        [B, A]`` their first tokens. The layer loop is unrolled in Python (L is small): each layer's
        window/causality is static, and XLA's cost analysis then counts every layer (it counts a loop
        body once). Returns hidden ``[B, A, T, H]`` (final-normed), the last layer's pre-injection state
        and, with ``collect_features``, every layer's post-injection feature ``[L, B, A, T, R]``.
        """
        b, a, t, h = x.shape
        pre, features = x, []
        for layer in range(drafter.config.num_layers):
            wrap = functools.partial(self.around_sublayer, drafter, layer, block=t)
            x = backbone_layer(drafter, layer, x.reshape(b, a * t, h), cos, sin, attend, wrap).reshape(b, a, t, h)
            pre = x
            if inject:
                x = self.after_layer(drafter, layer, x, anchor, replacement)
            if collect_features:
                features.append(self.layer_feature(drafter, layer, x))
        stacked = jnp.stack(features) if features and features[0] is not None else None
        return BlockForward(hidden=rms_norm(x, drafter.params.norm, drafter.config.rms_norm_eps), pre_injection=pre, features=stacked)

    # --- decode head ---

    def candidates(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array) -> Candidates:
        """Unary logits of slots 1..P over the vocabulary (or their top ``config.top_k``)."""
        logits = unary_logits(drafter, target, fwd.hidden[:, 1:])  # [B, P, V] (or [B, P, Vd])
        b, p, v = logits.shape
        if drafter.config.top_k >= v:
            every = vocab_ids(drafter, jnp.arange(v, dtype=jnp.int32))
            return Candidates(cand_ids=jnp.broadcast_to(every, (b, p, v)), scores=logits)
        scores, index = top_candidates(logits, drafter.config.top_k)
        return Candidates(cand_ids=vocab_ids(drafter, index), scores=scores)

    def select(self, cands: Candidates, slot_keys: Array, pick: Choose) -> tuple[Array, Array]:
        """Slots are independent: ``pick`` each from its own scores with its own key (``slot_keys``: one
        per slot, leading axis P) → tokens ``[B, P]``, q ``[B, P, C]``."""
        index, q = jax.vmap(pick, in_axes=(1, 0), out_axes=(1, 1))(cands.scores, slot_keys)
        return jnp.take_along_axis(cands.cand_ids, index[..., None], axis=-1)[..., 0], q

    def decode(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, keys: Array, sampling: Sampling) -> DraftOutput:
        """z-lab samples each slot from the target's sampling transform (temperature, then top-k, then
        top-p), so q has the same support as p. Greedy rows stay the argmax: the filters keep the top logit."""
        cands = self.candidates(drafter, target, fwd, anchor)
        scores = process_rows(cands.scores, sampling)  # the temperature is applied here
        unit = jnp.where(sampling.greedy, 0.0, 1.0)
        tokens, q = self.select(cands.replace(scores=scores), slot_keys(keys, scores.shape[1]), lambda s, k: choose(s, k, unit))
        return DraftOutput(tokens=tokens, cand_ids=cands.cand_ids, q=q)


def slot_keys(keys: Array, num: int) -> Array:
    """Per-row keys ``[B]`` → one key per slot and row ``[P, B]`` (the leading axis ``select`` walks)."""
    return jnp.moveaxis(split_rows(keys, num), 1, 0)


# ----------------------------------------------------------------------------------------------
# Drafting (what the speculative loop calls; dispatched to the drafter's kind)


def forward(drafter: Drafter, target: Target, cache: DraftCache, tokens: Array, inject: bool = True) -> BlockForward:
    """Run the block ``tokens [B, T]`` (normally ``block_tokens(anchor)``) at positions
    ``cache.lengths + arange(T)`` against the cached context → hidden / pre-injection ``[B, T, H]``.
    ``inject=False`` runs an injecting kind's backbone alone (used to cost the injection separately)."""
    config = drafter.config
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    x = embed_block(drafter, target.params.embed, tokens)[:, None]  # [B, 1, T, H]: one block per row
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, x.dtype)
    fwd = drafter.kind.forward_blocks(drafter, x, cos, sin, cache_attention(drafter, cache), tokens[:, :1], inject=inject)
    return BlockForward(hidden=fwd.hidden[:, 0], pre_injection=fwd.pre_injection[:, 0])


def decode(drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, keys: Array, sampling: Sampling) -> DraftOutput:
    """Proposals for slots 1..P from one block forward (the kind's decode head; module doc). ``keys [B]``
    and ``sampling`` (per row) are the target's sampling parameters: the DFlash draft distribution uses
    the same filters (DSpine's walk ignores them)."""
    return drafter.kind.decode(drafter, target, fwd, anchor, keys, sampling)


def draft(drafter: Drafter, target: Target, cache: DraftCache, anchor: Array, keys: Array, sampling: Sampling) -> DraftOutput:
    """One round's draft: ``anchor [B]`` at position ``cache.lengths`` → ``DraftOutput`` (module doc)."""
    fwd = forward(drafter, target, cache, block_tokens(drafter, anchor))
    return decode(drafter, target, fwd, anchor, keys, sampling)


def q_full(out: DraftOutput, vocab_size: int) -> Array:
    """Scatter the candidate distribution onto the vocabulary: ``[B, P, V]`` float32."""
    b, p, _ = out.q.shape
    full = jnp.zeros((b, p, vocab_size), jnp.float32)
    rows, slots = jnp.arange(b)[:, None, None], jnp.arange(p)[None, :, None]
    return full.at[rows, slots, out.cand_ids].add(out.q)
