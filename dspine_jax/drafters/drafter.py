"""Drafters: the drafting API, the backbone every kind shares, the kind registry's base ``DFlash``.

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
cache (``DraftCache``, a ring per layer: ``ring.py``, which also holds ``init_draft_cache`` and
``append_context``), and drafts a whole block in one forward::

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

from dspine_jax.drafters.config import DrafterConfig, register_drafter_kind
from dspine_jax.drafters.params import Attend, Drafter, DrafterParams
from dspine_jax.drafters.ring import DraftCache, cache_attention
from dspine_jax.models import quant
from dspine_jax.models.layers import apply_rope, rms_norm, rope_cos_sin, swiglu
from dspine_jax.models.sampling import Sampling, categorical_rows, process_rows, split_rows
from dspine_jax.models.target import Target, lm_logits


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
    # [B, P] float32: the drafter's predicted acceptance of each proposal (DSpark's confidence head), else None.
    # Slot k's may depend on the proposals before it, never on its own (round.speculative_round cuts on it).
    confidence: Array | None = None

    def first(self, num: int) -> DraftOutput:
        """The first ``num`` proposals."""
        head = lambda x: None if x is None else x[:, :num]  # noqa: E731
        return DraftOutput(tokens=head(self.tokens), cand_ids=head(self.cand_ids), q=head(self.q),
                           confidence=head(self.confidence))  # fmt: skip


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


# ``choose(scores [B, C], keys [B]) → (index [B], q [B, C])``: one slot's pick and the distribution it drew from.
Choose = Callable[[Array, Array], tuple[Array, Array]]
# ``wrap(sublayer, x [B, T', H], run) → [B, T', H]``: how one layer runs its "attention" or "mlp" sublayer
# ``run`` on its normed input ``x`` (the kind's ``around_sublayer``, bound to a layer and block length).
Wrap = Callable[[str, Array, Callable[[Array], Array]], Array]


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
    (``read_config``, ``write_config``, ``load_params``, ``params_tensors``, ``init_config``, ``init_params``;
    ``init_options`` names the extra ``init_drafter`` arguments ``init_config`` reads) — and registers
    itself; nothing else in the package names a kind. A kind with config fields of its own names its
    ``DrafterConfig`` subclass as ``config_class`` (which validates them) and reads / writes them itself.
    """

    name = "dflash"
    architecture = "DFlashDraftModel"  # config.json ``architectures`` entry of this kind's checkpoints
    config_section: str | None = None  # a config.json key whose presence marks this kind's checkpoints
    config_class: type[DrafterConfig] = DrafterConfig  # the config this kind's drafters carry
    injects = False  # whether ``after_layer`` changes the stream (``inject=False`` runs the backbone alone)
    init_options: tuple[str, ...] = ()  # kind-specific keyword arguments ``init_drafter`` accepts

    # --- config.json (the fields beyond the Qwen3 backbone and dflash_config) ---


    def verify_block(self, config: Any) -> int:
        """The longest verify block (anchor + proposals) one block forward drafts for: ``block_size`` (slot 0
        holds the anchor, slots 1 … T − 1 propose)."""
        return config.block_size
    def read_config(self, cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of ``config_class``: the parsed shared ``fields`` with the kind's own read
        from ``cfg`` (parsed only: ``config_class.validate`` checks their values). DFlash decodes over the whole
        vocabulary (C = V)."""
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
