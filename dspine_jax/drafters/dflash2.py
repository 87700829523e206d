"""The DFlash2 kind (z-lab ``DFlash2DraftModel``, ``dflash==0.1.0``): DFlash's backbone with each layer's
attention and MLP wrapped in grouped dynamic causal convolutions along the block, and a candidate selector
that walks the top-k candidates of every slot conditioned on the chosen predecessor.

Convolution (``around_sublayer``; one pair per wrapped sublayer). From the sublayer's normed input ``x``,
``kernel_projection: H → 2·K·G`` gives every position a dynamic kernel per group (G = H / group_size)
for "before" and "after"; ``base [2, K, H]`` is a static one. Before the sublayer
``y_t = Σ_{o<K} (base[0][o] + dyn_before[t, o]) ⊙ x_{t-o}``; after it the same with ``base[1]`` and
``dyn_after`` (still from ``x``) on the sublayer's output. It runs over each block's own positions, zero
before the block start — at decode time z-lab's forward sees the block only, so the anchor is position 0
and the context never enters the convolution.

Selector (decode head). Unary scores = the top-k (``selector_top_k``) DFlash logits of every slot;
walking left to right from the anchor, candidate j of slot t scores
``unary_j + ⟨pred_codebook[prev] ⊙ hidden_projection(h_t), succ_codebook[cand_j]⟩`` (h_t the final-normed
hidden). The hidden states are known before the walk and a predecessor is always one of the previous
slot's candidates (the anchor for slot 1), so every score is computed up front as a transition table
``[B, P, C, C]`` and the walk is DSpine's table walk (``DSpine.select``): greedy takes the argmax, a
sampled row draws from ``softmax(score / temperature)`` over the C candidates — z-lab's ``propose``,
whose q (zero outside the candidates, no top-p / top-k filter) is what lossless verification needs.

Checkpoints: the DFlash tensors plus ``layers.{i}.{attention,mlp}_conv.base_kernel [2, K, H]``,
``layers.{i}.{attention,mlp}_conv.kernel_projection.weight [2·K·G, H]``,
``candidate_selector.{predecessor,successor}_codebook [V, R]`` (z-lab's files name them without
``.weight``; its ``from_pretrained`` maps them, and we read either spelling) and
``candidate_selector.hidden_projection.weight [R, H]``. Letters as in drafter.py; K conv kernel,
G kernel groups, R selector rank, C = selector_top_k.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.drafters.config import (
    DrafterConfig,
    config_check,
    config_check_numbers,
    config_int,
    register_drafter_kind,
)
from dspine_jax.drafters.drafter import (
    BlockForward,
    Candidates,
    DFlash,
    DraftOutput,
    choose,
    slot_keys,
    top_candidates,
    unary_logits,
    vocab_ids,
)
from dspine_jax.drafters.dspine import DSpine
from dspine_jax.drafters.params import Drafter, DrafterParams, with_kind_weights
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import Target
from dspine_jax.models.weights import CheckpointError, take

# The config keys this kind adds (z-lab reads each with ``_draft_value``: dflash_config, then top level).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Fresh drafters (``init_drafter``): z-lab ships no defaults (its config must name every key); ours.
DEFAULT_KERNEL, DEFAULT_GROUP, DEFAULT_RANK = 4, 64, 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlash2Config(DrafterConfig):
    """A DFlash2 drafter's config: the shared fields plus the convolutions' and the selector's sizes
    (``selector_top_k`` is the shared ``top_k``)."""

    conv_kernel_size: int  # K of the grouped dynamic causal convolutions
    conv_group_size: int  # channels per dynamic-kernel group: H / conv_group_size groups
    selector_rank: int  # R of the candidate selector's codebooks (C = top_k)

    def validate(self) -> None:
        super().validate()
        config_check_numbers(self, ("conv_kernel_size", "conv_group_size", "selector_rank"), where="DFlash2")
        config_check(self.conv_kernel_size >= 1, f"DFlash2 conv_kernel_size={self.conv_kernel_size} must be >= 1")
        config_check(
            self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
            f"DFlash2 conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size} "
            "(the channels split into equal kernel groups)",
        )
        config_check(self.selector_rank >= 1, f"DFlash2 selector_rank={self.selector_rank} must be >= 1")


@struct.dataclass
class DynamicConv:
    """One sublayer's grouped dynamic causal convolutions (the one before it and the one after it)."""

    base: Array  # [2, K, H] static kernels: [0] before the sublayer, [1] after it
    projection: Array  # [H, 2·K·G] per-position dynamic kernels from the sublayer's normed input


@struct.dataclass
class Selector:
    """The candidate selector: token codebooks and the hidden projection that weights their product."""

    predecessor: Array  # [V, R]
    successor: Array  # [V, R]
    hidden: Array  # [H, R]


@struct.dataclass
class DFlash2Params(DrafterParams):
    """A DFlash2 drafter's weights: the shared backbone plus its convolutions and candidate selector."""

    attention_convs: tuple[DynamicConv, ...] = ()  # L, around each layer's attention
    mlp_convs: tuple[DynamicConv, ...] = ()  # L, around each layer's MLP
    selector: Selector | None = None


# ----------------------------------------------------------------------------------------------
# Grouped dynamic causal convolution (pure jnp: XLA on every backend)


def dynamic_kernels(x: Array, projection: Array, kernel_size: int) -> tuple[Array, Array]:
    """Per-position dynamic kernels from the normed sublayer input ``x [B, T', H]`` → before, after
    ``[B, T', K, G]`` each (z-lab views the projection as ``[..., 2, K, G]``)."""
    b, t, _ = x.shape
    dyn = (x @ projection).reshape(b, t, 2, kernel_size, -1)
    return dyn[:, :, 0], dyn[:, :, 1]


def grouped_causal_conv(x: Array, dynamic: Array, base: Array, block: int) -> Array:
    """``y_t = Σ_{o<K} (base[o] + dynamic[t, o, g(c)]) ⊙ x_{t-o}`` per channel c (group g(c) = c // (H/G)),
    causal inside each block: ``x_{t-o}`` is zero before the block start.

    x ``[B, T', H]`` (``T' = A·block``, block-major), dynamic ``[B, T', K, G]``, base ``[K, H]`` →
    ``[B, T', H]``. Offsets are added in z-lab's order (static term, then dynamic) so f32 sums agree."""
    b, t, h = x.shape
    k, g = base.shape[0], dynamic.shape[-1]
    blocks = x.reshape(b, t // block, block, g, h // g)  # [B, A, T, G, H/G]
    dyn = dynamic.reshape(b, t // block, block, k, g)[..., None].astype(x.dtype)  # [B, A, T, K, G, 1]
    base = base.reshape(k, g, h // g).astype(x.dtype)
    out = jnp.zeros_like(blocks)
    for o in range(min(k, block)):  # offsets reaching past the block start only ever see zeros
        shifted = blocks if o == 0 else jnp.pad(blocks[:, :, :-o], ((0, 0), (0, 0), (o, 0), (0, 0), (0, 0)))
        out = out + base[o] * shifted + dyn[:, :, :, o] * shifted
    return out.reshape(b, t, h)


# ----------------------------------------------------------------------------------------------
# The kind


@register_drafter_kind
class DFlash2(DFlash):
    """DFlash2 (z-lab ``DFlash2DraftModel(DFlashDraftModel)``): dynamic causal convolutions around every
    sublayer, C = ``selector_top_k`` candidates per slot and a selector walk over them."""

    name = "dflash2"
    architecture = "DFlash2DraftModel"
    config_class = DFlash2Config
    init_options = ("conv_kernel_size", "conv_group_size", "selector_rank")

    # --- config.json ---

    @staticmethod
    def settings(cfg: dict[str, Any]) -> dict[str, Any]:
        """This kind's keys as z-lab's ``_draft_value`` reads them: ``dflash_config`` first, else top level."""
        section = cfg.get("dflash_config") or {}
        return {key: section.get(key, cfg.get(key)) for key in DFLASH2_KEYS}

    def read_config(self, cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """DFlash's backbone fields (in-block causality as configured) plus the convolution and selector."""
        settings = self.settings(cfg)
        kernel, group, rank, top_k = (config_int(settings, key, "config (dflash_config or top level)") for key in DFLASH2_KEYS)
        return {**fields, "top_k": top_k, "conv_kernel_size": kernel, "conv_group_size": group, "selector_rank": rank}

    def write_config(self, config: DFlash2Config, cfg: dict[str, Any]) -> None:
        """DFlash's keys, and this kind's in ``dflash_config`` (where ``_draft_value`` looks first); a
        top-level copy the file already had is kept in step."""
        super().write_config(config, cfg)
        values = dict(
            conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size,
            selector_rank=config.selector_rank, selector_top_k=config.top_k,
        )  # fmt: skip
        cfg["dflash_config"] = {**(cfg.get("dflash_config") or {}), **values}
        cfg.update({key: value for key, value in values.items() if key in cfg})

    def init_config(self, cfg: dict[str, Any], hidden: int, vocab: int, options: dict[str, Any]) -> None:
        """Defaults: kernel 4, groups of 64 channels (fewer when 64 does not divide H), rank min(64, H),
        ``selector_top_k`` = ``init_drafter``'s ``top_k``."""
        group = options.get("conv_group_size") or next(g for g in range(min(DEFAULT_GROUP, hidden), 0, -1) if hidden % g == 0)
        cfg["dflash_config"] = {
            **cfg["dflash_config"],
            "conv_kernel_size": options.get("conv_kernel_size") or DEFAULT_KERNEL,
            "conv_group_size": group,
            "selector_rank": options.get("selector_rank") or min(DEFAULT_RANK, hidden),
            "selector_top_k": options["top_k"],
        }

    # --- weights ---

    @staticmethod
    def _shapes(config: DFlash2Config) -> tuple[int, int, int, int, int]:
        """K, G, H, R, V."""
        h = config.hidden_size
        return config.conv_kernel_size, h // config.conv_group_size, h, config.selector_rank, config.vocab_size

    def load_params(self, tensors: dict, config: DFlash2Config, target: Target, cast: Callable, backbone: DrafterParams) -> DFlash2Params:
        k, g, h, r, v = self._shapes(config)

        def conv(prefix: str) -> DynamicConv:
            return DynamicConv(
                base=cast(take(tensors, f"{prefix}.base_kernel", (2, k, h))),
                projection=cast(take(tensors, f"{prefix}.kernel_projection.weight", (2 * k * g, h)).T),
            )

        def codebook(name: str) -> Array:
            # z-lab's files store the embeddings without ``.weight`` (its from_pretrained maps them); a torch
            # state_dict has the suffix. Whichever is left over is reported as unexpected.
            plain = f"candidate_selector.{name}"
            return cast(take(tensors, plain if plain in tensors else f"{plain}.weight", (v, r)))

        n = config.num_layers
        return with_kind_weights(
            DFlash2Params,
            backbone,
            attention_convs=tuple(conv(f"layers.{i}.attention_conv") for i in range(n)),
            mlp_convs=tuple(conv(f"layers.{i}.mlp_conv") for i in range(n)),
            selector=Selector(
                predecessor=codebook("predecessor_codebook"),
                successor=codebook("successor_codebook"),
                hidden=cast(take(tensors, "candidate_selector.hidden_projection.weight", (r, h)).T),
            ),
        )

    def params_tensors(self, params: DrafterParams, config: DFlash2Config, host: Callable) -> dict[str, Any]:
        """z-lab's file layout: codebooks without ``.weight`` (what its ``from_pretrained`` expects)."""
        if not isinstance(params, DFlash2Params) or params.selector is None:
            raise CheckpointError("a dflash2 drafter's params must be DFlash2Params with a selector")
        out: dict[str, Any] = {}
        for i in range(config.num_layers):
            for prefix, conv in (("attention_conv", params.attention_convs[i]), ("mlp_conv", params.mlp_convs[i])):
                out[f"layers.{i}.{prefix}.base_kernel"] = host(conv.base)
                out[f"layers.{i}.{prefix}.kernel_projection.weight"] = host(conv.projection, True)
        out["candidate_selector.predecessor_codebook"] = host(params.selector.predecessor)
        out["candidate_selector.successor_codebook"] = host(params.selector.successor)
        out["candidate_selector.hidden_projection.weight"] = host(params.selector.hidden, True)
        return out

    def init_params(self, config: DFlash2Config, target: Target, keys: Any, dtype: jnp.dtype, backbone: DrafterParams) -> DFlash2Params:
        """Identity convolutions (``base[:, 0] = 1``, the rest and the projections zero: a fresh DFlash2's
        backbone computes exactly DFlash's; z-lab leaves ``base_kernel`` uninitialised) and the selector at
        HF's Embedding / Linear init N(0, initializer_range) — small, not zero, so its bilinear score has
        gradients."""
        k, g, h, r, v = self._shapes(config)
        std = float(json.loads(config.raw_json).get("initializer_range", 0.02))

        def normal(shape: tuple[int, ...]) -> Array:
            return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

        def identity() -> DynamicConv:
            return DynamicConv(base=jnp.zeros((2, k, h), dtype).at[:, 0].set(1), projection=jnp.zeros((h, 2 * k * g), dtype))

        n = config.num_layers
        return with_kind_weights(
            DFlash2Params,
            backbone,
            attention_convs=tuple(identity() for _ in range(n)),
            mlp_convs=tuple(identity() for _ in range(n)),
            selector=Selector(predecessor=normal((v, r)), successor=normal((v, r)), hidden=normal((h, r))),
        )

    # --- forward ---

    def around_sublayer(
        self, drafter: Drafter, layer: int, sublayer: str, x: Array, run: Callable[[Array], Array], *, block: int
    ) -> Array:
        """z-lab's ``GroupedDynamicCausalConv.prepare`` / ``finish`` around the sublayer: both dynamic
        kernels come from the sublayer's normed input ``x [B, A·T, H]``."""
        params = drafter.params
        conv = (params.attention_convs if sublayer == "attention" else params.mlp_convs)[layer]
        before, after = dynamic_kernels(x, conv.projection, drafter.config.conv_kernel_size)
        y = run(grouped_causal_conv(x, before, conv.base[0], block))
        return grouped_causal_conv(y, after, conv.base[1], block)

    # --- decode head ---

    def selector_scores(self, drafter: Drafter, hidden: Array, unary: Array, cand_ids: Array, predecessors: Array) -> Array:
        """``unary_j + ⟨pred[prev_k] ⊙ proj(h), succ[cand_j]⟩`` for every predecessor k and candidate j:
        hidden ``[..., H]`` (final-normed), unary and cand_ids ``[..., C]``, predecessors ``[..., K]`` →
        float32 ``[..., K, C]``. The decode table (K = the previous slot's candidates) and the training
        loss (K = 1, the true predecessor) both score through here."""
        sel = drafter.params.selector
        query = hidden @ sel.hidden  # [..., R]
        weighted = sel.predecessor[predecessors] * query[..., None, :]  # [..., K, R] (z-lab's product order)
        pair = jnp.einsum("...kr,...jr->...kj", weighted, sel.successor[cand_ids], preferred_element_type=jnp.float32)
        return unary[..., None, :].astype(jnp.float32) + pair

    def transition_table(self, drafter: Drafter, hidden: Array, unary: Array, cand_ids: Array, anchor: Array) -> Array:
        """``T[b, i, k, j]`` = ``selector_scores`` of candidate j given predecessor candidate k: hidden
        ``[B, P, H]`` (final-normed, slots 1..P), unary and cand_ids ``[B, P, C]``, anchor ``[B]`` → float32
        ``[B, P, C, C]``. Slot 1's predecessors are all the anchor (its C rows are identical); slot i ≥ 2's
        are the C candidates of slot i-1."""
        b, _, c = cand_ids.shape
        predecessors = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, c)), cand_ids[:, :-1]], axis=1)
        return self.selector_scores(drafter, hidden, unary, cand_ids, predecessors)

    def candidates(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array) -> Candidates:
        """The unary top-``selector_top_k`` per slot and their transition table ``[B, P, C, C]``."""
        hidden = fwd.hidden[:, 1:]  # [B, P, H]
        unary, index = top_candidates(unary_logits(drafter, target, hidden), drafter.config.top_k)  # [B, P, C]
        cand_ids = vocab_ids(drafter, index)
        table = self.transition_table(drafter, hidden, unary, cand_ids, anchor.astype(jnp.int32))
        return Candidates(cand_ids=cand_ids, scores=table)

    # The walk: a ``lax.scan`` of row look-ups ``T[i, k_prev, :]`` and picks, exactly DSpine's.
    select = DSpine.select

    def decode(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, keys: Array, sampling: Sampling) -> DraftOutput:
        """A sampled row's slot i draws from ``softmax(T[i, k_prev, :] / temperature)`` (z-lab's ``propose``:
        no top-p / top-k filter — the walk is already restricted to the C candidates)."""
        cands = self.candidates(drafter, target, fwd, anchor)
        keys = slot_keys(keys, cands.cand_ids.shape[1])
        tokens, q = self.select(cands, keys, lambda s, k: choose(s, k, sampling.temperature))
        return DraftOutput(tokens=tokens, cand_ids=cands.cand_ids, q=q)
