"""Drafter test helpers shared by several modules (jitted once per process: compiles dominate on CPU)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import params as params_mod
from dspine_jax.drafters.ring import DraftCache, append_context
from dspine_jax.models.target import Target, init_cache
from dspine_jax.models.target import forward as target_forward

append = jax.jit(append_context)
forward = jax.jit(D.forward, static_argnames="inject")


@jax.jit
def _block_logits(drafter: params_mod.Drafter, target: Target, cache: DraftCache, anchor: jax.Array) -> jax.Array:
    fwd = D.forward(drafter, target, cache, D.block_tokens(drafter, anchor))
    return D.unary_logits(drafter, target, fwd.hidden[:, 1:])


def block_logits(drafter: params_mod.Drafter, target: Target, cache: DraftCache, anchor) -> np.ndarray:
    """Unary logits of slots 1.. ``[B, P, V]`` for ``anchor [B]``."""
    return np.asarray(_block_logits(drafter, target, cache, jnp.asarray(anchor, jnp.int32)))


def tapped_features(target: Target, seqs: np.ndarray, taps) -> jax.Array:
    """The target's tapped hidden states ``[n, B, T, H]`` of ``seqs [B, T]``."""
    seqs = np.asarray(seqs)
    return target_forward(target, init_cache(target, seqs.shape[0], 32), jnp.asarray(seqs), tuple(taps))[1]


def with_random_injection(drafter: params_mod.Drafter, seed: int, scale: float = 1.0) -> params_mod.Drafter:
    """A "trained" DSpine drafter: random non-zero writes, predecessor_gate and bias (a fresh one has them at
    zero, so its q never depends on the predecessor); ``scale`` multiplies the writes (a stronger injection)."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    inj = drafter.params.injection
    m, r = drafter.config.message_size, drafter.config.transfer_rank
    dtype = drafter.dtype
    inj = inj.replace(
        writes=tuple(
            (scale * jax.random.normal(k, w.shape) / math.sqrt(m)).astype(dtype)
            for k, w in zip(jax.random.split(k1, len(inj.writes)), inj.writes)
        ),
        predecessor_gate=(jax.random.normal(k2, inj.predecessor_gate.shape) / math.sqrt(r)).astype(dtype),
        bias=(0.1 * jax.random.normal(k3, inj.bias.shape)).astype(dtype),
    )
    return drafter.replace(params=drafter.params.replace(injection=inj))
