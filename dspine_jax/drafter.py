"""DFlash / DSpine drafters: backbone, adjacent causal injection, transfer codes, decode head.

Drafting API (what the speculative loop calls)
==============================================

The drafter reads the target's tapped hidden states of *committed* tokens through a per-row context
cache, and drafts a whole block in one forward::

    cache = init_draft_cache(drafter, batch, capacity)                  # empty, lengths = 0
    cache = append_context(drafter, cache, tapped, num_new)             # tapped [n, B, T, H], num_new [B]
    out   = draft(drafter, target, cache, anchor, key, temperature, top_p, top_k)  # anchor [B] int32
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
* ``draft`` is pure and static-shaped: ``jax.jit(draft)(drafter, target, cache, anchor, key, t)`` is the
  whole round-draft (backbone, injection, top-K, transition table, walk) as one compiled call.
  ``temperature`` is a traced float32 scalar: ``<= 0`` means greedy, so one compilation serves both.
* DFlash mode: in-block attention as configured (bidirectional by default), no injection, each slot
  decoded independently from its own logits; C = vocab size (``cand_ids`` is ``arange(V)``), so ``q`` is
  ``sampling.sampling_probs(logits, temperature, top_p, top_k)``: the target's own sampling transform,
  exactly as z-lab's ``dflash_generate`` builds its draft distribution.
* DSpine mode: causal in-block attention, injection after every layer, C = ``top_k`` candidates from the
  unary logits (the drafter config's ``top_k``, not the sampling one), last-write refinement (LWR) table
  ``[B, P, C, C]`` and a left-to-right ``lax.scan`` over table look-ups; at temperature > 0 slot i samples
  from ``softmax(T[i, k_prev, :] / temperature)`` (top-p / top-k sampling filters do not apply: the walk
  is already restricted to the C candidates, like z-lab's DFlash2 ``propose``).

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

Everything here is functional. Parameters are ``[in, out]`` (torch checkpoints are ``[out, in]``;
drafter_io.py transposes). Letters follow layers.py: B batch, T block, S key slots, H, N/K heads, D,
F, V, L layers, C candidates, R transfer rank, M message width; P = T - 1 proposal slots.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.cache import KV_AXES, LENGTHS_AXES, sharded_zeros
from dspine_jax.drafter_config import DrafterConfig
from dspine_jax.layers import apply_rope, rms_norm, rope_cos_sin, swiglu
from dspine_jax.mesh import per_device, weight
from dspine_jax.sampling import process_logits
from dspine_jax.target import Target, lm_logits
from kernels.pallas import draft_attention as _attention_kernel
from kernels.pallas import transition_cache as _transition_kernel

# F.normalize's epsilon: a zero readout stays zero instead of dividing by zero.
_NORMALIZE_EPS = 1e-12


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
class Injection:
    """DSpine adjacent causal injection: per-layer readouts/writes, shared message/gates/bias."""

    readouts: tuple[Array, ...]  # L × [H, R]
    writes: tuple[Array, ...]  # L × [M, H]
    message: Array  # [R, M]
    receiver_gate: Array  # [R, M]
    predecessor_gate: Array  # [R, M]
    bias: Array  # [M]


@struct.dataclass
class DrafterParams:
    fc: Array  # [n_taps*H, H]
    hidden_norm: Array  # [H]
    layers: tuple[DrafterLayer, ...]  # L layers
    norm: Array  # [H]
    injection: Injection | None = None  # DSpine only
    transfer_codes: Array | None = None  # [V, R] DSpine only; fixed, derived from the target's LM head


@struct.dataclass
class Drafter:
    """A drafter: params (pytree) + static config. Pass it straight into ``jax.jit``."""

    params: DrafterParams
    config: DrafterConfig = struct.field(pytree_node=False)

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

    k: tuple[Array, ...]  # L × [B, K, S, D] after k_norm + RoPE
    v: tuple[Array, ...]  # L × [B, K, S, D]
    lengths: Array  # [B] int32: context tokens committed so far = position of the next anchor

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


@struct.dataclass
class BlockForward:
    hidden: Array  # [B, T, H] after the final norm (unary logits come from here)
    pre_injection: Array  # [B, T, H] last layer's output before its injection (LWR restarts here)


@struct.dataclass
class DraftOutput:
    tokens: Array  # [B, P] int32 proposals for block slots 1..P
    cand_ids: Array  # [B, P, C] int32
    q: Array  # [B, P, C] float32, rows sum to 1


# ----------------------------------------------------------------------------------------------
# Draft context cache


def init_draft_cache(drafter: Drafter, batch: int, capacity: int) -> DraftCache:
    """An empty ring for ``batch`` rows. ``capacity`` = the longest sequence (prompt + generated) a row
    will reach; with every layer windowed the ring is capped at ``max(window) - 1`` slots."""
    config = drafter.config
    slots = capacity
    if all(w > 0 for w in config.layer_windows):
        slots = min(capacity, max(max(config.layer_windows) - 1, 1))
    shape = (batch, config.num_kv_heads, slots, config.head_dim)
    zeros = tuple(sharded_zeros(shape, drafter.dtype, KV_AXES) for _ in range(config.num_layers))
    return DraftCache(k=zeros, v=zeros, lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES))


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


def append_context(drafter: Drafter, cache: DraftCache, tapped: Array, num_new: Array) -> DraftCache:
    """Commit ``num_new [B]`` (≤ T) tokens' target features ``tapped [n, B, T, H]`` at positions
    ``lengths … lengths+num_new-1``: every layer's context K/V into the ring, then ``lengths += num_new``.

    Context K/V depend only on ``ctx`` and each layer's own k/v projections (``ctx`` does not pass through
    ``input_layernorm``), so every layer's are computed here, once, rather than inside the draft forward.
    Only the last ``S`` of a row's new tokens are written (a long prompt into a short window ring), so
    no two writes of one call hit the same slot.
    """
    config = drafter.config
    b, kh, s, d = cache.k[0].shape
    t = tapped.shape[2]
    ctx = fuse_context(drafter, tapped)  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
    cos, sin = rope_cos_sin(positions, d, config.rope_theta, ctx.dtype)  # [B, T, D]
    num_new = num_new.astype(jnp.int32)
    offset = jnp.arange(t)[None, :]
    keep = (offset < num_new[:, None]) & (offset >= num_new[:, None] - s)  # [B, T]
    slots = jnp.where(keep, jnp.mod(positions, s), s)  # slot s is out of range → dropped
    rows = jnp.arange(b)[:, None]
    new_k, new_v = [], []
    for lp, cache_k, cache_v in zip(drafter.params.layers, cache.k, cache.v):
        k = apply_rope(
            rms_norm((ctx @ lp.k).reshape(b, t, kh, d), lp.k_norm, config.rms_norm_eps), cos, sin
        )  # [B, T, K, D]
        v = (ctx @ lp.v).reshape(b, t, kh, d)
        # A scatter along S of the heads-major buffer: in place (no cache-sized copy) for f32 on
        # XLA:CPU and on accelerators. (XLA:CPU converts a bf16 buffer to f32 around a scatter.)
        new_k.append(cache_k.at[rows, :, slots].set(k, mode="drop"))
        new_v.append(cache_v.at[rows, :, slots].set(v, mode="drop"))
    return cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)


# ----------------------------------------------------------------------------------------------
# DSpine injection pieces (shared by the forward, LWR, the transition table and the sequential walk
# so that the table and the sequential reference run literally the same math)


def _feature(h: Array, readout: Array, rank: int) -> Array:
    """``√R · normalize(readout(h))`` — h ``[..., H]``, readout ``[H, R]`` → ``[..., R]``; norm in f32."""
    projected = (h @ readout).astype(jnp.float32)
    norm = jnp.maximum(jnp.linalg.norm(projected, axis=-1, keepdims=True), _NORMALIZE_EPS)
    return (math.sqrt(rank) * (projected / norm)).astype(h.dtype)


def _code(drafter: Drafter, token_ids: Array) -> Array:
    """Predecessor message of a known token: ``√R · C[token]`` — ``[...]`` → ``[..., R]``."""
    codes = drafter.params.transfer_codes
    return codes[token_ids] * jnp.asarray(math.sqrt(drafter.config.transfer_rank), codes.dtype)


def _write(inj: Injection, layer: int, h: Array, receiver_logit: Array, predecessor: Array) -> Array:
    """``h + (‖h‖/√H) · write_l(σ(receiver_gate(f) + predecessor_gate(pred) + bias) ⊙ message(pred))``.

    h ``[..., H]``; receiver_logit = ``receiver_gate(f)`` ``[..., M]`` (precomputed: it depends on the
    receiving slot only, so LWR computes it once per slot instead of once per candidate); predecessor
    ``[..., R]``. Leading axes broadcast. (``transition_table``'s reference path,
    ``kernels/pallas/transition_cache.py``, runs the same ops for every candidate predecessor.)
    """
    gate = jax.nn.sigmoid(receiver_logit + predecessor @ inj.predecessor_gate + inj.bias)
    delta = (gate * (predecessor @ inj.message)) @ inj.writes[layer]  # [..., H]
    scale = (jnp.linalg.norm(h.astype(jnp.float32), axis=-1, keepdims=True) / math.sqrt(h.shape[-1])).astype(h.dtype)
    return h + scale * delta


def _inject(drafter: Drafter, layer: int, h: Array, anchor: Array) -> Array:
    """One layer's adjacent injection on ``h [B, T, H]``. Slot 0 is untouched; slot 1's predecessor is
    the anchor's code, slot t ≥ 2's is slot t-1's readout feature. All features are read before any
    write, so every slot updates in parallel."""
    inj, rank = drafter.params.injection, drafter.config.transfer_rank
    features = _feature(h, inj.readouts[layer], rank)  # [B, T, R]
    predecessors = jnp.concatenate([_code(drafter, anchor)[:, None, :], features[:, 1:-1]], axis=1)  # [B, P, R]
    successors = _write(inj, layer, h[:, 1:], features[:, 1:] @ inj.receiver_gate, predecessors)
    return jnp.concatenate([h[:, :1], successors], axis=1)


def refine(drafter: Drafter, pre: Array, predecessor_ids: Array) -> Array:
    """Last-write refinement: redo the last layer's write from its pre-injection state with a known
    predecessor token's code, then the final norm. pre ``[..., H]``, predecessor_ids ``[...]`` → ``[..., H]``."""
    inj, last = drafter.params.injection, drafter.config.num_layers - 1
    receiver_logit = _feature(pre, inj.readouts[last], drafter.config.transfer_rank) @ inj.receiver_gate
    written = _write(inj, last, pre, receiver_logit, _code(drafter, predecessor_ids))
    return rms_norm(written, drafter.params.norm, drafter.config.rms_norm_eps)


def _head_rows(target: Target, ids: Array) -> Array:
    """LM-head rows of token ids: ``[...]`` → ``[..., H]`` (a column gather from the ``[H, V]`` head, so
    the full head is never transposed)."""
    return jnp.moveaxis(jnp.take(target.params.lm_head, ids, axis=1), 0, -1)


def transition_table(drafter: Drafter, target: Target, pre: Array, cand_ids: Array, anchor: Array) -> Array:
    """``T[b, i, k, j] = ⟨LWR(pre_i, C[pred_{i,k}]), head[cand_{i,j}]⟩`` for every adjacent candidate pair.

    pre ``[B, P, H]`` (pre-injection states of slots 1..P), cand_ids ``[B, P, C]``, anchor ``[B]`` →
    float32 ``[B, P, C, C]``. Slot 1's predecessors are all the anchor (its C rows are identical); slot
    i ≥ 2's are the C candidates of slot i-1.
    """
    inj, last = drafter.params.injection, drafter.config.num_layers - 1
    b, _, c = cand_ids.shape
    predecessors = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, c)), cand_ids[:, :-1]], axis=1)
    receiver_logit = _feature(pre, inj.readouts[last], drafter.config.transfer_rank) @ inj.receiver_gate  # [B, P, M]
    weights = _transition_kernel.LWRWeights(inj.predecessor_gate, inj.message, inj.bias, inj.writes[last], drafter.params.norm)
    # Kernel dispatch (kernels/pallas/dispatch.py, at trace time): the jnp reference (the same ops as
    # ``refine`` + scoring), or the fused Pallas kernel that keeps the [B, P, C, H] refined states on chip.
    # Under a mesh each device scores its own rows.
    rows = ("batch", None, None)
    scores = per_device(
        functools.partial(_transition_kernel.transition_scores, eps=drafter.config.rms_norm_eps),
        [rows, rows, rows + (None,), rows + (None,), None], rows + (None,),
    )  # fmt: skip
    return scores(pre, receiver_logit, _code(drafter, predecessors), _head_rows(target, cand_ids), weights)


# ----------------------------------------------------------------------------------------------
# Backbone forward


def block_tokens(drafter: Drafter, anchor: Array) -> Array:
    """``[anchor, MASK × (T-1)]`` → ``[B, T]`` int32."""
    t = drafter.config.block_size
    mask = jnp.full((anchor.shape[0], t - 1), drafter.config.mask_token_id, jnp.int32)
    return jnp.concatenate([anchor.astype(jnp.int32)[:, None], mask], axis=1)


def _layer(drafter: Drafter, layer: int, x: Array, cache: DraftCache, cos: Array, sin: Array) -> Array:
    """One decoder layer on the block ``x [B, T, H]``: queries from the block, keys/values from
    ``[cached context ; block]``."""
    config = drafter.config
    lp = drafter.params.layers[layer]
    b, t, _ = x.shape
    n, kh, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    normed = rms_norm(x, lp.input_norm, eps)
    q = apply_rope(rms_norm((normed @ lp.q).reshape(b, t, n, d), lp.q_norm, eps), cos, sin)
    k = apply_rope(rms_norm((normed @ lp.k).reshape(b, t, kh, d), lp.k_norm, eps), cos, sin)
    v = (normed @ lp.v).reshape(b, t, kh, d)
    # Kernel dispatch (kernels/pallas/dispatch.py, at trace time): the jnp reference, or the Pallas kernel with
    # the same semantics (tiles skipped, not masked). Under a mesh each device attends its own rows and heads
    # (query heads split together with their KV heads).
    heads, kv_heads, ctx = ("batch", None, "heads", None), ("batch", None, "kv_heads", None), ("batch", "kv_heads", None, None)
    attention = per_device(
        functools.partial(_attention_kernel.draft_attention, window=config.layer_windows[layer], causal=config.layer_causal[layer]),
        [heads, ctx, ctx, kv_heads, kv_heads, ("batch",)], heads,
    )  # fmt: skip
    attn = attention(q, cache.k[layer], cache.v[layer], k, v, cache.lengths)
    x = x + attn.reshape(b, t, n * d) @ lp.o
    return x + swiglu(rms_norm(x, lp.post_norm, eps), lp.gate, lp.up, lp.down)


def forward(drafter: Drafter, target: Target, cache: DraftCache, tokens: Array, inject: bool = True) -> BlockForward:
    """Run the block ``tokens [B, T]`` (normally ``block_tokens(anchor)``) at positions
    ``cache.lengths + arange(T)`` against the cached context.

    The layer loop is unrolled in Python (L is small): each layer's window/causality is static, and
    XLA's cost analysis then counts every layer (it counts a loop body once). ``inject=False`` runs a
    DSpine drafter's backbone alone (used to cost the injection separately).
    """
    config = drafter.config
    t = tokens.shape[1]
    x = target.params.embed[tokens].astype(drafter.dtype)  # [B, T, H]: the target's own embedding
    if config.input_embedding_scale != 1.0:
        x = x * config.input_embedding_scale
    positions = cache.lengths[:, None] + jnp.arange(t)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, x.dtype)
    use_injection = inject and config.is_dspine
    pre = x
    for layer in range(config.num_layers):
        x = _layer(drafter, layer, x, cache, cos, sin)
        pre = x
        if use_injection:
            x = _inject(drafter, layer, x, tokens[:, 0])
    return BlockForward(hidden=rms_norm(x, drafter.params.norm, config.rms_norm_eps), pre_injection=pre)


def unary_logits(drafter: Drafter, target: Target, hidden: Array) -> Array:
    """``hidden [..., H]`` → float32 logits ``[..., V]`` with z-lab's optional multiplier / soft-cap."""
    config = drafter.config
    logits = lm_logits(target, hidden)
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    if config.final_logit_softcapping > 0:
        cap = config.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


# ----------------------------------------------------------------------------------------------
# Decode head


def choose(scores: Array, key: Array, temperature: Array) -> tuple[Array, Array]:
    """Pick one candidate per row of ``scores [B, C]``: argmax at ``temperature <= 0``, else a sample from
    ``softmax(scores / temperature)``. Returns index ``[B]`` and the distribution used ``[B, C]``
    (one-hot at temperature 0)."""
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0
    scaled = scores / jnp.where(greedy, 1.0, temperature)
    best = jnp.argmax(scores, axis=-1)
    index = jnp.where(greedy, best, jax.random.categorical(key, scaled, axis=-1))
    q = jnp.where(greedy, jax.nn.one_hot(best, scores.shape[-1], dtype=jnp.float32), jax.nn.softmax(scaled, axis=-1))
    return index.astype(jnp.int32), q


def walk(table: Array, cand_ids: Array, key: Array, temperature: Array) -> tuple[Array, Array]:
    """Left-to-right walk over the transition table: ``lax.scan`` over slots, each step a row look-up
    ``T[i, k_prev, :]`` and a choice — no matmul inside the loop.

    table ``[B, P, C, C]``, cand_ids ``[B, P, C]`` → tokens ``[B, P]``, q ``[B, P, C]``. Slot i uses
    ``jax.random.split(key, P)[i]``.
    """
    b, p, _ = cand_ids.shape

    def step(prev: Array, xs: tuple[Array, Array, Array]) -> tuple[Array, tuple[Array, Array]]:
        table_i, cand_i, key_i = xs  # [B, C, C], [B, C], key
        row = jnp.take_along_axis(table_i, prev[:, None, None], axis=1)[:, 0]  # [B, C]
        index, q = choose(row, key_i, temperature)
        token = jnp.take_along_axis(cand_i, index[:, None], axis=1)[:, 0]
        return index, (token, q)

    xs = (jnp.moveaxis(table, 1, 0), jnp.moveaxis(cand_ids, 1, 0), jax.random.split(key, p))
    # Slot 1's rows are all conditioned on the anchor, so any start index reads the same row.
    _, (tokens, q) = jax.lax.scan(step, jnp.zeros((b,), jnp.int32), xs)
    return jnp.moveaxis(tokens, 0, 1), jnp.moveaxis(q, 0, 1)


def walk_sequential(
    drafter: Drafter, target: Target, pre: Array, cand_ids: Array, anchor: Array, key: Array, temperature: Array
) -> tuple[Array, Array]:
    """Reference for ``walk``: at each slot, re-run the last write for the predecessor actually chosen
    and score the candidates (P sequential refinements). Same keys and choice rule as ``walk``."""
    _, p, _ = cand_ids.shape
    keys = jax.random.split(key, p)
    previous = anchor.astype(jnp.int32)
    tokens, qs = [], []
    for i in range(p):
        refined = refine(drafter, pre[:, i], previous)  # [B, H]
        scores = jnp.einsum(
            "bh,bjh->bj", refined, _head_rows(target, cand_ids[:, i]), preferred_element_type=jnp.float32
        )
        index, q = choose(scores, keys[i], temperature)
        previous = jnp.take_along_axis(cand_ids[:, i], index[:, None], axis=1)[:, 0]
        tokens.append(previous)
        qs.append(q)
    return jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1)


def decode(
    drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, key: Array, temperature: Array,
    top_p: Array | float = 1.0, top_k: int = 0,
) -> DraftOutput:
    """Proposals for slots 1..P from one block forward (see the module doc for the two modes).

    ``top_p`` (traced) and ``top_k`` (static) are the sampling filters of the target's distribution; the
    DFlash draft distribution uses the same ones (DSpine's walk ignores them)."""
    config = drafter.config
    logits = unary_logits(drafter, target, fwd.hidden[:, 1:])  # [B, P, V]
    b, p, v = logits.shape
    if config.is_dspine:
        _, cand_ids = jax.lax.top_k(logits, config.top_k)  # [B, P, C], best first
        # The barrier stops XLA from folding top_k's index output into the gathers below, which
        # turns top_k into a full sort of [B, P, V] on CPU (measured: 294 ms → 64 ms per draft).
        cand_ids = jax.lax.optimization_barrier(cand_ids.astype(jnp.int32))
        table = transition_table(drafter, target, fwd.pre_injection[:, 1:], cand_ids, anchor)
        tokens, q = walk(table, cand_ids, key, temperature)
        return DraftOutput(tokens=tokens, cand_ids=cand_ids, q=q)
    if config.top_k >= v:
        scores, cand_ids = logits, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (b, p, v))
    else:
        scores, cand_ids = jax.lax.top_k(logits, config.top_k)
        cand_ids = cand_ids.astype(jnp.int32)
    # z-lab samples each slot from the target's sampling transform (temperature, then top-k, then top-p),
    # so q has the same support as p. Greedy stays the argmax: the filters always keep the top logit.
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0
    scores = process_logits(scores, jnp.where(greedy, 1.0, temperature), top_p, top_k)
    unit = jnp.where(greedy, 0.0, 1.0)  # the temperature is already applied
    # Slots are independent in DFlash; same per-slot key schedule as the walk.
    index, q = jax.vmap(choose, in_axes=(1, 0, None), out_axes=(1, 1))(scores, jax.random.split(key, p), unit)
    tokens = jnp.take_along_axis(cand_ids, index[..., None], axis=-1)[..., 0]
    return DraftOutput(tokens=tokens, cand_ids=cand_ids, q=q)


def draft(
    drafter: Drafter, target: Target, cache: DraftCache, anchor: Array, key: Array, temperature: Array,
    top_p: Array | float = 1.0, top_k: int = 0,
) -> DraftOutput:
    """One round's draft: ``anchor [B]`` at position ``cache.lengths`` → ``DraftOutput`` (module doc).
    Under ``jax.jit`` pass ``top_k`` as a static argument."""
    fwd = forward(drafter, target, cache, block_tokens(drafter, anchor))
    return decode(drafter, target, fwd, anchor, key, temperature, top_p, top_k)


def q_full(out: DraftOutput, vocab_size: int) -> Array:
    """Scatter the candidate distribution onto the vocabulary: ``[B, P, V]`` float32."""
    b, p, _ = out.q.shape
    full = jnp.zeros((b, p, vocab_size), jnp.float32)
    rows, slots = jnp.arange(b)[:, None, None], jnp.arange(p)[None, :, None]
    return full.at[rows, slots, out.cand_ids].add(out.q)


# ----------------------------------------------------------------------------------------------
# Transfer codes


def transfer_codes_from_head(lm_head: Array, rank: int, chunk: int = 4096) -> tuple[Array, Array]:
    """Fixed token codes from the target's LM head ``[H, V]`` → codes ``[V, R]``, directions ``[H, R]``.

    Rows (tokens) are L2-normalised, centred, projected on the top-``rank`` principal directions of their
    covariance, whitened by 1/√eigenvalue and L2-normalised again (SpecForge ``initialize_transfer_space``).
    Directions come out in ascending eigenvalue order like ``torch.linalg.eigh`` (so readouts initialised
    from them line up with SpecForge's). Eigenvector signs are arbitrary in any eigensolver; we fix each
    direction's sign so its largest-magnitude component is positive, which makes the result reproducible
    and independent of the head's row order. The covariance is accumulated in ``chunk``-row slices in
    float32 (highest matmul precision) so a 250k × 5k head never needs a second full-size copy.
    Load-time only (it checks the eigenvalues on the host), not for use under ``jit``.
    """
    h, v = lm_head.shape
    if not 0 < rank <= min(h, v - 1):
        raise ValueError(f"transfer rank {rank} must be in [1, min(hidden={h}, vocab-1={v - 1})]")
    chunk = min(chunk, v)
    pad = (-v) % chunk
    rows = jnp.pad(lm_head.T, ((0, pad), (0, 0))).reshape(-1, chunk, h)  # zero rows add nothing below

    def normalized(x: Array) -> Array:
        x = x.astype(jnp.float32)
        return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), _NORMALIZE_EPS)

    def accumulate(carry: tuple[Array, Array], x: Array) -> tuple[tuple[Array, Array], None]:
        total, cov = carry
        xn = normalized(x)
        return (total + xn.sum(0), cov + jnp.matmul(xn.T, xn, precision=jax.lax.Precision.HIGHEST)), None

    zeros = (jnp.zeros((h,), jnp.float32), jnp.zeros((h, h), jnp.float32))
    (total, cov), _ = jax.lax.scan(accumulate, zeros, rows)
    mean = total / v
    cov = cov - v * jnp.outer(mean, mean)
    cov = 0.5 * (cov + cov.T)  # exact symmetry for eigh
    values, directions = jnp.linalg.eigh(cov)
    values, directions = values[-rank:], directions[:, -rank:]  # ascending, like torch
    if not bool(jnp.all(jnp.isfinite(values)) & jnp.all(values > 0)):
        raise ValueError("the target head has fewer positive principal directions than the transfer rank")
    pivot = jnp.argmax(jnp.abs(directions), axis=0)
    directions = directions * jnp.sign(directions[pivot, jnp.arange(rank)])[None, :]

    def project(x: Array) -> Array:
        z = jnp.matmul(normalized(x) - mean, directions, precision=jax.lax.Precision.HIGHEST) / jnp.sqrt(values)
        return z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), _NORMALIZE_EPS)

    codes = jax.lax.map(project, rows).reshape(-1, rank)[:v]
    return codes, directions
