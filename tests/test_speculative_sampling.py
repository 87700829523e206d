"""Speculative sampling is lossless: its outputs are distributed exactly as plain sampling's.

Statistical tests, all at fixed seeds (so each is deterministic; the false-failure rate below is the
chance that a *correct* implementation fails for a fresh seed). Each check is a chi-square
goodness-of-fit test of observed counts against the exact distribution of plain sampling (computed
from the target's logits with ``sampling_probs``), with bins of expected count < 5 pooled, at
significance ALPHA = 1e-4 per check (Wilson–Hilferty quantile; 6 checks → ≤ 6e-4 overall). A token
drawn where plain sampling has probability exactly 0 (filtered by top-k / top-p) fails outright.

* ``accept_sampling`` alone, 200k rows with fixed logits and a poor full-vocabulary draft distribution:
  the first emitted token, the second given the first proposal was kept, and the bonus after a full
  accept, each against its slot's target distribution (temperature / top-k / top-p applied).
* End to end (prefill + while_loop, ``jax.vmap``-ed over 20480 seeds, one prompt): the joint
  distribution of the first 3 generated tokens on a vocab-8 target (512 cells) with a fresh random
  DSpine drafter (top-4 candidates, verify 2: exercises the residual over candidates and the bonus)
  and a fresh random DFlash drafter with temperature 0.8, top-k 5, top-p 0.9 (verify 4).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_hf_model

from dspine_jax import target as tgt
from dspine_jax.drafter import DraftOutput
from dspine_jax.drafter_io import init_drafter
from dspine_jax.sampling import sampling_probs
from dspine_jax.speculative import DrafterProposer, accept_sampling, generate_impl
from dspine_jax.target import load_target

ALPHA = 1e-4
Z_ALPHA = 3.719016485455709  # standard normal upper quantile at ALPHA


def chi2_quantile(dof: int, z: float = Z_ALPHA) -> float:
    """Wilson–Hilferty approximation of the chi-square upper quantile (accurate to <1% for dof ≥ 3)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Statistic and threshold for observed ``counts`` against exact ``probs`` (same shape)."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token plain sampling can never draw was drawn"
    probs = probs / probs.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, chi2_quantile(len(obs) - 1)


def assert_fits(counts: np.ndarray, probs: np.ndarray) -> None:
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f} (alpha {ALPHA})"


# ----------------------------------------------------------------------------------------------
# The acceptance rule alone


def test_accept_sampling_matches_target_distribution():
    rows, v, t = 200_000, 8, 3
    rng = np.random.default_rng(0)
    logits = jnp.asarray(np.broadcast_to(rng.normal(0, 1.5, (1, t, v)), (rows, t, v)), jnp.float32)
    temperature, top_p, top_k = 0.7, 0.8, 4
    p = np.asarray(sampling_probs(logits[:1], temperature, top_p, top_k))[0]  # [T, V]
    assert (p == 0).any()  # filtering is exercised
    q = rng.dirichlet(np.ones(v), size=t - 1).astype(np.float32)  # [P, V]: poor, full support
    key_draft, key_accept = jax.random.split(jax.random.key(1))
    proposals = jax.random.categorical(key_draft, jnp.log(jnp.asarray(q)), shape=(rows, t - 1)).astype(jnp.int32)
    proposal = DraftOutput(
        tokens=proposals,
        cand_ids=jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (rows, t - 1, v)),
        q=jnp.broadcast_to(jnp.asarray(q), (rows, t - 1, v)),
    )
    emitted, accepted = jax.jit(accept_sampling, static_argnames="top_k")(
        key_accept, logits, proposal, jnp.float32(temperature), jnp.float32(top_p), top_k
    )
    emitted, accepted = np.asarray(emitted), np.asarray(accepted)
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == t - 1).mean() > 0.05  # every path taken
    assert_fits(np.bincount(emitted[:, 0], minlength=v), p[0])  # kept proposal or residual at slot 0
    assert_fits(np.bincount(emitted[accepted >= 1, 1], minlength=v), p[1])  # … at slot 1
    assert_fits(np.bincount(emitted[accepted == 2, 2], minlength=v), p[2])  # bonus after a full accept


# ----------------------------------------------------------------------------------------------
# End to end


PROMPT = [3, 5, 7, 4, 6]
V = 8
SAMPLES, CHUNK = 20480, 4096


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    model_dir, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("v8") / "llama", seed=2, vocab_size=V)
    return load_target(model_dir)


def exact_joint(target, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """P(t1, t2, t3) under plain sampling: ``[V, V, V]`` from the logits of every 2-token continuation."""
    n = len(PROMPT)
    seqs = np.array([[*PROMPT, a, b] for a in range(V) for b in range(V)], np.int32)
    hidden, _, _ = tgt.forward(target, tgt.init_cache(target, len(seqs), n + 2), jnp.asarray(seqs))
    p = np.asarray(sampling_probs(tgt.lm_logits(target, hidden), temperature, top_p, top_k), np.float64)
    p1, p2, p3 = p[0, n - 1], p[::V, n].reshape(V, V), p[:, n + 1].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_first_three(target, proposer, temperature: float, top_p: float, top_k: int, verify_len: int):
    tokens = jnp.asarray([PROMPT + [0] * (16 - len(PROMPT))], jnp.int32)
    lengths = jnp.asarray([len(PROMPT)], jnp.int32)

    def one(key):  # one row per seed; vmap turns seeds into the batch
        return generate_impl(
            target, proposer, tokens, lengths, key, jnp.float32(temperature), jnp.float32(top_p),
            jnp.asarray([-1], jnp.int32), jnp.int32(3),
            capacity=16, out_width=3, verify_len=verify_len, top_k=top_k, greedy=False,
        )

    run = jax.jit(jax.vmap(one))
    outs, accepted = [], []
    for chunk in range(SAMPLES // CHUNK):
        out, counts, _, _, acc, rounds, *_ = run(jax.random.split(jax.random.key(100 + chunk), CHUNK))
        assert (np.asarray(counts) == 3).all()
        outs.append(np.asarray(out)[:, 0, :3])
        accepted.append(np.asarray(acc)[:, 0, 0])
    return np.concatenate(outs), np.concatenate(accepted)


@pytest.mark.parametrize(
    "kind,temperature,top_p,top_k,verify_len",
    [("dspine", 1.0, 1.0, 0, 2), ("dflash", 0.8, 0.9, 5, 4)],
)
def test_speculative_sampling_joint_distribution(small_vocab_target, kind, temperature, top_p, top_k, verify_len):
    target = small_vocab_target
    drafter = init_drafter(target, kind, num_layers=1, block_size=4, top_k=4, seed=5)
    samples, accepted = sample_first_three(target, DrafterProposer(drafter), temperature, top_p, top_k, verify_len)
    # A poor drafter: proposals are both rejected and accepted (fully, too) often.
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == verify_len - 1).mean() > 0.02
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (samples[:, 0], samples[:, 1], samples[:, 2]), 1)
    assert_fits(counts, exact_joint(target, temperature, top_p, top_k))
