"""Speculative sampling is lossless: its outputs are distributed exactly as plain sampling's.

Statistical tests, all at fixed seeds (so each is deterministic; the false-failure rate below is the
chance that a *correct* implementation fails for a fresh seed). Each check is a chi-square
goodness-of-fit test of observed counts against the exact distribution of plain sampling (computed
from the target's logits with ``sampling_probs``), with bins of expected count < 5 pooled. The critical
value is the exact chi-square quantile ``scipy.stats.chi2.ppf(1 - ALPHA, dof)`` for the pooled bins'
degrees of freedom, ALPHA = 1e-4 per check, so a correct implementation fails one of the 5 checks for a
fresh seed with probability ≤ 5e-4. A token drawn where plain sampling has probability exactly 0
(filtered by top-k / top-p) fails outright.

* ``accept_sampling`` alone, 200k rows with fixed logits and a poor full-vocabulary draft distribution:
  the first emitted token, the second given the first proposal was kept, and the bonus after a full
  accept, each against its slot's target distribution (temperature / top-k / top-p applied).
* End to end (prefill + while_loop, ``jax.vmap``-ed over 20480 seeds, one prompt): the joint
  distribution of the first 4 generated tokens on a vocab-6 target (1296 cells) with verify length 4, so
  tokens 2–4 come from one round's 3 proposals (kept, or the residual at the first rejection, or the
  bonus): a DSpine drafter with random non-zero injection weights (its q at slot i depends on the token
  chosen at slot i-1 through the LWR table; top-4 candidates, residual over candidates), a DFlash
  drafter with temperature 0.8, top-k 5, top-p 0.9 (its q built with the same filters), and a DFlash
  drafter with a draft vocabulary of 4 of the 6 tokens (q zero on the other two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_hf_model
from drafter_helpers import append, forward, tapped_features, with_random_injection
from flax import struct
from scipy import stats

from dspine_jax.decoding.accept import accept_sampling
from dspine_jax.decoding.proposers import OracleProposer
from dspine_jax.decoding.speculative import generate_impl, speculative_generate
from dspine_jax.drafters import drafter as D
from dspine_jax.drafters.drafter import DraftOutput
from dspine_jax.drafters.dspine import SPINE
from dspine_jax.drafters.io import init_drafter, with_draft_vocab
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling, sampling_probs
from dspine_jax.models.target import load_target

ALPHA = 1e-4  # per-check false-failure probability


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Statistic and critical value for observed ``counts`` against exact ``probs`` (same shape)."""
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
    return stat, float(stats.chi2.ppf(1 - ALPHA, len(obs) - 1))


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
    emitted, accepted = jax.jit(accept_sampling)(
        jax.random.split(key_accept, rows), logits, proposal, Sampling.rows(rows, temperature, top_p, top_k)
    )
    emitted, accepted = np.asarray(emitted), np.asarray(accepted)
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == t - 1).mean() > 0.05  # every path taken
    assert_fits(np.bincount(emitted[:, 0], minlength=v), p[0])  # kept proposal or residual at slot 0
    assert_fits(np.bincount(emitted[accepted >= 1, 1], minlength=v), p[1])  # … at slot 1
    assert_fits(np.bincount(emitted[accepted == 2, 2], minlength=v), p[2])  # bonus after a full accept


# ----------------------------------------------------------------------------------------------
# End to end


PROMPT = [3, 5, 1, 4, 2]  # ids < V
V = 6
N_TOKENS = 4
SAMPLES, CHUNK = 20480, 4096


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    model_dir, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("v6") / "llama", seed=2, vocab_size=V)
    return load_target(model_dir)


def exact_joint(target, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """P(t1 … t_N) under plain sampling, ``[V] * N``, from the logits of every (N-1)-token continuation."""
    n = len(PROMPT)
    tails = np.stack(np.meshgrid(*[np.arange(V)] * (N_TOKENS - 1), indexing="ij"), -1).reshape(-1, N_TOKENS - 1)
    seqs = np.concatenate([np.broadcast_to(PROMPT, (len(tails), n)), tails], axis=1).astype(np.int32)
    hidden, _, _, _ = tgt.forward(target, tgt.init_cache(target, len(seqs), seqs.shape[1]), jnp.asarray(seqs))
    p = np.asarray(sampling_probs(tgt.lm_logits(target, hidden), temperature, top_p, top_k), np.float64)
    p = p.reshape(*[V] * (N_TOKENS - 1), seqs.shape[1], V)  # [tail…, position, next]
    joint = p[(0,) * (N_TOKENS - 1) + (n - 1,)]  # t1 does not depend on the tail
    for i in range(1, N_TOKENS):  # t_{i+1} given t_1…t_i: the row whose tail starts with them
        index = (slice(None),) * i + (0,) * (N_TOKENS - 1 - i) + (n - 1 + i,)
        joint = joint[..., None] * p[index]
    return joint


def sample_first_tokens(target, proposer, temperature: float, top_p: float, top_k: int, verify: int | tuple):
    """``verify``: a fixed length (the jitted loop, vmapped over seeds), or a schedule of lengths pinned round
    by round (``speculative_generate``'s adaptive loop, its length forced to change every round; one row
    per sample, every row with its own key)."""
    if isinstance(verify, tuple):
        outs, accepted = [], []
        for chunk in range(SAMPLES // CHUNK):
            res = speculative_generate(
                target, proposer, [PROMPT] * CHUNK, N_TOKENS, temperature=temperature, top_p=top_p, top_k=top_k,
                seed=100 + chunk, stop_ids=[], verify_schedule=list(verify), verify_costs={1: 1.0, 2: 1.0, 4: 1.0},
            )
            assert all(row == list(verify)[: len(row)] for row in res.verify_lengths)
            outs.append(np.asarray(res.token_ids))
            accepted.append(np.asarray([row[0] for row in res.accepted_proposals]))
        return np.concatenate(outs), np.concatenate(accepted)
    tokens = jnp.asarray([PROMPT + [0] * (16 - len(PROMPT))], jnp.int32)
    lengths = jnp.asarray([len(PROMPT)], jnp.int32)

    def one(key):  # one row per seed; vmap turns seeds into the batch
        return generate_impl(
            target, proposer, tokens, lengths, key, jnp.float32(temperature), jnp.float32(top_p),
            jnp.asarray([-1], jnp.int32), jnp.int32(N_TOKENS),
            capacity=16, out_width=N_TOKENS, verify_len=verify, top_k=top_k, greedy=False,
        )

    run = jax.jit(jax.vmap(one))
    outs, accepted = [], []
    for chunk in range(SAMPLES // CHUNK):
        res = run(jax.random.split(jax.random.key(100 + chunk), CHUNK))
        assert (np.asarray(res.written) == N_TOKENS).all()
        outs.append(np.asarray(res.tokens)[:, 0, :N_TOKENS])
        accepted.append(np.asarray(res.accepted)[:, 0, 0])
    return np.concatenate(outs), np.concatenate(accepted)


def make_drafter(target, kind: str):
    if kind == "dflash+vocab":  # a draft vocabulary of 4 of the 6 tokens: q is zero on the other two
        drafter = init_drafter(target, "dflash", num_layers=1, block_size=4, top_k=4, seed=5, initializer_range=0.2)
        return with_draft_vocab(drafter, target, [0, 2, 3, 5])
    drafter = init_drafter(target, kind, num_layers=1, block_size=4, top_k=4, seed=5, initializer_range=0.2)
    if kind == "dspine":
        # Writes ×4: the injection is strong enough that q reported from the wrong predecessor's table row
        # fails the fit (tried: χ² 2879 against the 997 critical value; the correct walk gives 814).
        drafter = with_random_injection(drafter, seed=7, scale=4.0)
        # The point of the DSpine case: q at slot i ≥ 2 must depend on the token chosen at slot i-1.
        tapped = tapped_features(target, [PROMPT], drafter.config.target_layer_ids)
        cache = append(drafter, init_draft_cache(drafter, 1, 16), tapped, jnp.array([len(PROMPT)]))
        anchor = jnp.array([PROMPT[-1]], jnp.int32)
        fwd = forward(drafter, target, cache, D.block_tokens(drafter, anchor))
        cand = jax.lax.top_k(D.unary_logits(drafter, target, fwd.hidden[:, 1:]), 4)[1].astype(jnp.int32)
        table = jax.nn.softmax(SPINE.transition_table(drafter, target, fwd.pre_injection[:, 1:], cand, anchor), axis=-1)
        assert float(jnp.abs(table[:, 1:] - table[:, 1:, :1]).max()) > 0.1
    return drafter


@pytest.mark.parametrize(
    "kind,temperature,top_p,top_k,verify_len",
    # The last case switches verify lengths every round (2, 1, 4, 2, …): losslessness may not depend on them.
    [("dspine", 1.0, 0.9, 0, 4), ("dflash", 0.8, 0.9, 5, 4), ("dspine", 1.0, 0.9, 0, (2, 1, 4, 2)),
     ("dflash+vocab", 1.0, 1.0, 0, 4)],
)
def test_speculative_sampling_joint_distribution(small_vocab_target, kind, temperature, top_p, top_k, verify_len):
    target = small_vocab_target
    drafter = make_drafter(target, kind)
    samples, accepted = sample_first_tokens(target, DrafterProposer(drafter), temperature, top_p, top_k, verify_len)
    first = verify_len[0] if isinstance(verify_len, tuple) else verify_len
    # A poor drafter: proposals are both rejected and accepted (fully, too) often.
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == first - 1).mean() > 0.02
    counts = np.zeros((V,) * N_TOKENS, np.int64)
    np.add.at(counts, tuple(samples.T), 1)
    assert_fits(counts, exact_joint(target, temperature, top_p, top_k))


@struct.dataclass
class SpyProposer(OracleProposer):
    """Records the sampling filters the loop hands the proposer (every round, every row)."""

    def propose(self, target, state, anchor, counts, keys, sampling, num):
        def record(top_k, top_p):
            SEEN["top_k"].update(int(k) for k in top_k)
            SEEN["top_p"].update(round(float(p), 6) for p in top_p)

        jax.debug.callback(record, sampling.top_k, sampling.top_p)
        return super().propose(target, state, anchor, counts, keys, sampling, num)


SEEN: dict[str, set] = {}


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 0.7, 3), (0.0, 0.7, 3)])
def test_loop_passes_the_sampling_filters_to_the_drafter(small_vocab_target, temperature, top_p, top_k):
    """The draft distribution can only use p's transform if the loop passes it (greedy needs none)."""
    SEEN.update(top_k=set(), top_p=set())
    reference = jnp.zeros((1, 16), jnp.int32)
    spy = SpyProposer(reference=reference, accept=jnp.zeros((1, 1), jnp.int32), vocab_size=V)
    speculative_generate(
        small_vocab_target, spy, [PROMPT], 6, temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=[],
        block_size=3,
    )
    jax.effects_barrier()  # debug callbacks run asynchronously
    expected = ({top_k}, {top_p}) if temperature > 0 else ({0}, {1.0})
    assert (SEEN["top_k"], SEEN["top_p"]) == expected
