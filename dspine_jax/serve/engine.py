"""Continuous-batching engine: a fixed number of slots, one speculative round per engine step.

Device state (persistent, donated to every jitted call): the target cache and the drafter's context
cache, ``S`` rows each (one row per slot), ``context_length + T_max`` positions per row (the ``T_max``
slack keeps a verify block inside the buffer, as in ``speculative_generate``).

Host state (numpy, per slot, passed into each step — a few hundred bytes): the anchor (last emitted
token, not yet in the target cache), whether the slot runs, its sampling parameters (temperature,
top-p, top-k per slot) and its PRNG key. The host is the source of truth for token counts, budgets and
stop strings; the device only knows cache lengths.

Jitted pieces (compiled once per shape; ``EngineCore.warmup`` compiles every shape, which the server
does in the background before it reports ready):

* ``prefill_slot`` — run one prompt chunk (padded to a power-of-two width, 32 … ``max_prompt_bucket``)
  on slot ``i``'s row (a fresh batch-1 cache for a prompt's first chunk), commit its length, and write
  that row back into the persistent caches (every cache leaf is batch-major, so a
  ``dynamic_update_slice`` per leaf); returns the next token, sampled with the slot's own parameters.
  A prompt wider than the largest width is prefilled in several chunks (``plan_prefill``),
  so no prompt length compiles a new shape.
* ``step`` — one round for all slots: draft (per-row temperature and keys), verify ``[S, T]``, accept
  (greedy rows: longest argmax prefix + bonus; sampled rows: lossless speculative sampling with
  per-row temperature / top-p / top-k), stop at the engine's stop ids, cut at each slot's remaining
  budget, commit. The step runs on the first ``rows`` slots only (a power-of-two bucket covering every
  running slot; requests take the lowest free slot), so idle slots cost no compute; idle slots inside the
  bucket run too (static shapes) but commit nothing. With ``verify_len == 1`` and no drafter it is a
  plain autoregressive step (``--no-speculative``).

Per-row top-k: ``lax.top_k`` needs a static k, so the k-th largest logit is read from a descending
sort at a per-row index (k = 0 → no cut); top-p reuses the same sort. The sort runs only when some
running row asks for top-k or top-p (``lax.cond``), and the sampling path only when some row samples.

Greedy rows use exactly ``accept_greedy`` on the target's f32 logits, so their output equals
``generate``'s (the same argument as for ``speculative_generate``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh

from dspine_jax import drafter as dr
from dspine_jax import target as tgt
from dspine_jax.drafter import Drafter, DraftOutput
from dspine_jax.mesh import DATA, use_mesh
from dspine_jax.sharding import shard_drafter, shard_target
from dspine_jax.speculative import accept_greedy

MIN_PROMPT_BUCKET = 32


def prompt_widths(context_length: int, max_prompt_bucket: int) -> list[int]:
    """Prefill chunk widths: powers of two from 32 up to ``max_prompt_bucket`` and the context (at least 32)."""
    top = max(MIN_PROMPT_BUCKET, min(max_prompt_bucket, context_length))
    return [MIN_PROMPT_BUCKET << i for i in range((top // MIN_PROMPT_BUCKET).bit_length())]


def cache_capacity(context_length: int, max_verify: int) -> int:
    """Positions per slot: room for a verify block past the context, and for a prompt's last chunk padded
    to 32 (chunks start at multiples of 32, so a 32-wide tail always fits; see ``plan_prefill``)."""
    padded = -(-context_length // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET
    return max(context_length + max_verify, padded)


def plan_prefill(n: int, widths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """``(offset, width)`` chunks covering an ``n``-token prompt, each of one of the compiled ``widths``
    (ascending): the smallest width that holds the rest inside the cache, else the largest the rest fills."""
    plan, offset = [], 0
    while offset < n:
        rest = n - offset
        fits = [w for w in widths if w >= rest and offset + w <= capacity]
        width = fits[0] if fits else max(w for w in widths if w <= rest)
        plan.append((offset, width))
        offset += width
    return plan


# ----------------------------------------------------------------------------------------------
# Per-row sampling pieces


def _split_rows(keys: Array, num: int) -> Array:
    """Typed keys ``[B]`` → ``[B, num]``."""
    return jax.vmap(lambda k: jax.random.split(k, num))(keys)


def process_logits_rows(logits: Array, temperature: Array, top_p: Array, top_k: Array) -> Array:
    """``logits [B, T, V]`` with per-row ``temperature``, ``top_p``, ``top_k [B]`` → filtered float32 logits.

    Same order and tie rules as ``sampling.process_logits`` (temperature, then top-k, then top-p over
    the top-k survivors; top-p keeps the token crossing the threshold). ``temperature`` must be > 0 here.
    """
    v = logits.shape[-1]
    x = logits.astype(jnp.float32) / temperature[:, None, None]

    def cut(x: Array) -> Array:
        desc = jnp.sort(x, axis=-1)[..., ::-1]  # [B, T, V]
        k = jnp.where((top_k > 0) & (top_k < v), top_k, v)[:, None, None]  # [B, 1, 1]
        kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), axis=-1)
        x = jnp.where(x < kth, -jnp.inf, x)
        desc = jnp.where(jnp.arange(v) < k, desc, -jnp.inf)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p[:, None, None]
        threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        threshold = jnp.where((top_p < 1.0)[:, None, None], threshold, -jnp.inf)
        return jnp.where(x < threshold, -jnp.inf, x)

    need = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    return jax.lax.cond(need, cut, lambda x: x, x)


def _choose_rows(scores: Array, keys: Array, temperature: Array) -> tuple[Array, Array]:
    """``drafter.choose`` with a temperature and key per row: scores ``[B, C]``, keys ``[B]``, temperature ``[B]``."""
    greedy = temperature <= 0
    scaled = scores / jnp.where(greedy, 1.0, temperature)[:, None]
    best = jnp.argmax(scores, axis=-1)
    sampled = jax.vmap(lambda k, s: jax.random.categorical(k, s))(keys, scaled)
    index = jnp.where(greedy, best, sampled)
    q = jnp.where(
        greedy[:, None], jax.nn.one_hot(best, scores.shape[-1], dtype=jnp.float32), jax.nn.softmax(scaled, axis=-1)
    )
    return index.astype(jnp.int32), q


def draft_rows(
    drafter: Drafter, target: tgt.Target, cache: dr.DraftCache, anchor: Array, keys: Array, temperature: Array, num: int
) -> DraftOutput:
    """``drafter.draft`` with per-row temperature and keys (``[B]``) → ``num`` proposals per row.

    The drafter kind's own forward, candidates and selection (DFlash per slot, DSpine's walk); only the
    choice step is per-row (``drafter.choose`` takes one temperature and one key for the batch)."""
    if num + 1 < drafter.config.block_size and all(drafter.config.layer_causal):
        drafter = drafter.replace(config=dataclasses.replace(drafter.config, block_size=num + 1))
    fwd = dr.forward(drafter, target, cache, dr.block_tokens(drafter, anchor))
    cands = drafter.kind.candidates(drafter, target, fwd, anchor)
    slot_keys = jnp.moveaxis(_split_rows(keys, cands.cand_ids.shape[1]), 1, 0)  # [P', B]
    tokens, q = drafter.kind.select(cands, slot_keys, lambda scores, k: _choose_rows(scores, k, temperature))
    return DraftOutput(tokens=tokens[:, :num], cand_ids=cands.cand_ids[:, :num], q=q[:, :num])


def accept_sampling_rows(
    keys: Array, logits: Array, proposal: DraftOutput | None, temperature: Array, top_p: Array, top_k: Array
) -> tuple[Array, Array]:
    """``speculative.accept_sampling`` with per-row parameters and keys ``[B]``; ``proposal=None`` (T = 1)
    is plain sampling. Returns emitted ``[B, T]`` (valid up to ``accepted``), accepted ``[B]``."""
    b, t, _ = logits.shape
    p_num = t - 1
    both = _split_rows(keys, 2)
    key_accept, key_final = both[:, 0], both[:, 1]
    p = jax.nn.softmax(process_logits_rows(logits, temperature, top_p, top_k), axis=-1)  # [B, T, V]
    rows = jnp.arange(b)
    if p_num == 0:
        final = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(key_final, p[:, 0])
        return final[:, None].astype(jnp.int32), jnp.zeros((b,), jnp.int32)
    tokens, cand_ids, q = proposal.tokens, proposal.cand_ids, proposal.q
    p_x = jnp.take_along_axis(p[:, :-1], tokens[..., None], axis=-1)[..., 0]  # [B, P]
    q_x = jnp.sum(jnp.where(cand_ids == tokens[..., None], q, 0.0), axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (p_num,), jnp.float32))(key_accept)
    ok = u * q_x < p_x
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_stop = p[rows, accepted]
    slot = jnp.minimum(accepted, p_num - 1)
    q_stop = jnp.zeros_like(p_stop).at[rows[:, None], cand_ids[rows, slot]].add(q[rows, slot])
    residual = jnp.maximum(p_stop - q_stop, 0.0)
    use_p = (accepted == p_num) | (jnp.sum(residual, axis=-1) <= 0.0)
    final_dist = jnp.where(use_p[:, None], p_stop, residual)
    final = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(key_final, final_dist).astype(jnp.int32)
    emitted = jnp.concatenate([tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(t)[None, :] == accepted[:, None], final[:, None], emitted)
    return emitted, accepted


# ----------------------------------------------------------------------------------------------
# Jitted engine functions


def _write_row(big, small, slot: Array):
    """Write the batch-1 pytree ``small`` into row ``slot`` of the batch-major pytree ``big``."""
    return jax.tree.map(lambda b, s: jax.lax.dynamic_update_slice_in_dim(b, s.astype(b.dtype), slot, axis=0), big, small)


def _resume_row(big, empty, slot: Array, fresh: Array):
    """Row ``slot`` of the batch-major pytree ``big`` as a batch-1 pytree, or ``empty`` when ``fresh``
    (a ``cond``, not a select: a prompt's first chunk does not read the slot's old row)."""
    row = lambda: jax.tree.map(lambda b: jax.lax.dynamic_slice_in_dim(b, slot, 1, axis=0), big)  # noqa: E731
    return jax.lax.cond(fresh, lambda: empty, row)


@functools.partial(jax.jit, donate_argnames=("cache", "dstate"))
def prefill_slot(
    target: tgt.Target, drafter: Drafter | None, cache, dstate, tokens: Array, length: Array, slot: Array,
    fresh: Array, key_data: Array, temperature: Array, top_p: Array, top_k: Array,
):
    """Prompt chunk ``tokens [1, W]`` (``length`` real tokens) appended to row ``slot`` (to an empty row when
    ``fresh``, a prompt's first chunk) → caches with that row replaced, and the token after the chunk ``[]``
    (only the last chunk's is used).

    ``temperature`` etc. are scalars (this request's); temperature 0 = greedy."""
    capacity = cache.capacity
    taps = drafter.config.target_layer_ids if drafter is not None else ()
    small = _resume_row(cache, tgt.init_cache(target, 1, capacity), slot, fresh)
    lengths = length[None].astype(jnp.int32)
    hidden, tapped, small, saved = tgt.forward(target, small, tokens, taps)
    small = tgt.replay(target, small, saved, lengths)
    cache = _write_row(cache, small, slot)
    if drafter is not None:
        dsmall = _resume_row(dstate, dr.init_draft_cache(drafter, 1, capacity), slot, fresh)
        dsmall = dr.append_context(drafter, dsmall, tapped, lengths)
        dstate = _write_row(dstate, dsmall, slot)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)  # [1, 1, H]
    logits = tgt.lm_logits(target, last)  # [1, 1, V]
    key = jax.random.wrap_key_data(key_data)
    greedy_tok = jnp.argmax(logits[0, 0]).astype(jnp.int32)
    temp = jnp.where(temperature > 0, temperature, 1.0)[None]
    sampled, _ = accept_sampling_rows(key[None], logits, None, temp, top_p[None], top_k[None])
    first = jnp.where(temperature > 0, sampled[0, 0], greedy_tok)
    return cache, dstate, first


@functools.partial(jax.jit, static_argnames=("verify_len", "rows"), donate_argnames=("cache", "dstate"))
def step(
    target: tgt.Target, drafter: Drafter | None, cache, dstate, anchor: Array, running: Array, remaining: Array,
    key_data: Array, temperature: Array, top_p: Array, top_k: Array, stop_ids: Array, *, verify_len: int,
    rows: int,
):
    """One engine step over the first ``rows`` slots (the host keeps running requests in low slots and
    picks the smallest compiled bucket that covers them, so idle slots cost nothing); see ``step_rows``.
    The per-slot inputs are ``[rows]``; the caches stay ``[S, …]`` and are updated in place."""
    s = cache.lengths.shape[0]
    if rows == s:
        return step_rows(target, drafter, cache, dstate, anchor, running, remaining, key_data, temperature, top_p,
                         top_k, stop_ids, verify_len=verify_len)
    head = lambda tree: jax.tree.map(lambda x: x[:rows], tree)  # noqa: E731
    sub_cache, sub_dstate, *out = step_rows(
        target, drafter, head(cache), head(dstate), anchor, running, remaining, key_data, temperature, top_p, top_k,
        stop_ids, verify_len=verify_len,
    )
    put = lambda big, small: jax.tree.map(  # noqa: E731
        lambda b, x: jax.lax.dynamic_update_slice_in_dim(b, x, 0, axis=0), big, small)
    return (put(cache, sub_cache), put(dstate, sub_dstate), *out)


def step_rows(
    target: tgt.Target, drafter: Drafter | None, cache, dstate, anchor: Array, running: Array, remaining: Array,
    key_data: Array, temperature: Array, top_p: Array, top_k: Array, stop_ids: Array, *, verify_len: int,
):
    """One engine step over all ``S`` slots.

    ``anchor [S]`` last emitted token per slot; ``running [S]`` bool; ``remaining [S]`` tokens the slot may
    still emit (≥ 1 for running slots); ``key_data [S, 2]``; per-slot sampling parameters ``[S]``
    (temperature 0 = greedy). Returns the caches, emitted ``[S, T]``, ``n_keep [S]`` (tokens of emitted
    to append, 0 for idle slots), ``accepted [S]`` (proposals verification accepted), ``hit_stop [S]``
    (the kept tokens end on a stop id) and the next key data.
    """
    t = verify_len
    s = anchor.shape[0]
    keys = jax.random.wrap_key_data(key_data)
    split = _split_rows(keys, 3)
    key_next, key_draft, key_accept = split[:, 0], split[:, 1], split[:, 2]
    greedy = temperature <= 0
    slots = jnp.arange(t)[None, :]

    proposal = None
    if t > 1:
        draft_temp = jnp.where(greedy, 0.0, temperature)
        proposal = draft_rows(drafter, target, dstate, anchor, key_draft, draft_temp, t - 1)
        block = jnp.concatenate([anchor[:, None], proposal.tokens.astype(jnp.int32)], axis=1)
    else:
        block = anchor[:, None]
    taps = drafter.config.target_layer_ids if (drafter is not None and t > 1) else ()
    hidden, tapped, cache, saved = tgt.forward(target, cache, block, taps)
    logits = tgt.lm_logits(target, hidden)  # [S, T, V] f32

    if t > 1:
        emitted, accepted = accept_greedy(logits, proposal.tokens)
    else:
        emitted, accepted = jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros((s,), jnp.int32)
    sampling = running & ~greedy

    def sample_path(_):
        temp = jnp.where(greedy, 1.0, temperature)
        e, a = accept_sampling_rows(key_accept, logits, proposal, temp, top_p, top_k)
        return jnp.where(sampling[:, None], e, emitted), jnp.where(sampling, a, accepted)

    emitted, accepted = jax.lax.cond(jnp.any(sampling), sample_path, lambda _: (emitted, accepted), None)

    is_stop = jnp.isin(emitted, stop_ids) & (slots <= accepted[:, None])
    until_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, t)
    n_keep = jnp.minimum(jnp.minimum(accepted + 1, until_stop), remaining)
    n_keep = jnp.where(running, jnp.maximum(n_keep, 0), 0)
    hit_stop = jnp.any(is_stop & (slots < n_keep[:, None]), axis=1)
    # The anchor and the kept proposals enter the caches; the last kept token is the next anchor.
    cache = tgt.replay(target, cache, saved, n_keep)
    if t > 1:
        dstate = dr.append_context(drafter, dstate, tapped, n_keep)
    return cache, dstate, emitted, n_keep, accepted, hit_stop, jax.random.key_data(key_next)


@functools.partial(jax.jit, donate_argnames=("cache", "dstate"))
def reset_slot(cache, dstate, slot: Array):
    """Zero a freed slot's lengths (its buffers are overwritten by the next prefill)."""
    cache = cache.replace(lengths=cache.lengths.at[slot].set(0))
    if dstate is not None:
        dstate = dstate.replace(lengths=dstate.lengths.at[slot].set(0))
    return cache, dstate


# ----------------------------------------------------------------------------------------------
# Host-side engine core (single-threaded; the server drives it from one worker thread)


@dataclasses.dataclass
class SlotParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclasses.dataclass
class StepResult:
    tokens: dict[int, list[int]]  # slot → tokens appended this step
    finished: dict[int, str]  # slot → "stop" (stop id) or "length" (budget)
    accepted: list[int]  # per running slot: tokens committed this step (the acceptance length, bonus incl.)
    num_running: int


class EngineCore:
    """Slots + persistent caches + the jitted functions. Not thread-safe: call from one thread."""

    def __init__(
        self, target: tgt.Target, drafter: Drafter | None, *, num_slots: int, context_length: int,
        verify_len: int | None = None, sps_table: dict[int, int] | None = None, stop_ids: Sequence[int] | None = None,
        bucket_rows: bool = True, mesh: Mesh | None = None, max_prompt_bucket: int = 256,
    ):
        """``mesh``: decode tensor/data parallel on a ``data`` × ``model`` mesh (dspine_jax/mesh.py); the
        target and drafter are laid out on it here, and slots are split over ``data``.
        ``max_prompt_bucket``: the widest prefill chunk; longer prompts are prefilled in chunks."""
        config = target.config
        dp = mesh.shape[DATA] if mesh is not None else 1
        if num_slots % dp:
            raise ValueError(f"{num_slots} slots do not split over {dp} data-parallel groups; use a multiple of {dp}")
        if mesh is not None:
            target = shard_target(target, mesh)
            drafter = shard_drafter(drafter, mesh) if drafter is not None else None
        self.mesh = mesh
        if context_length < 2 or context_length > config.max_position_embeddings:
            raise ValueError(
                f"context length {context_length} must be in [2, {config.max_position_embeddings}] (the model's positions)"
            )
        self.target, self.drafter = target, drafter
        self.num_slots, self.context_length = num_slots, context_length
        if drafter is None:
            self.verify_lengths = {1: 1}
        else:
            block = drafter.config.block_size
            if sps_table:
                self.verify_lengths = {b: max(2, min(v, block)) for b, v in sps_table.items()}
            else:
                self.verify_lengths = {1: max(2, min(verify_len or block, block))}
        self.max_verify = max(self.verify_lengths.values())
        self.prompt_widths = prompt_widths(context_length, max_prompt_bucket)
        self.capacity = cache_capacity(context_length, self.max_verify)
        self._init_caches()
        stops = list(config.eos_token_ids if stop_ids is None else stop_ids)
        stops += [-1] * (-(-max(len(stops), 1) // 8) * 8 - len(stops))
        self.stop_ids = jnp.asarray(stops, jnp.int32)
        self.stop_set = {int(x) for x in stops if x >= 0}
        s = num_slots
        self.anchor = np.zeros(s, np.int32)
        self.running = np.zeros(s, bool)
        self.remaining = np.zeros(s, np.int32)
        self.key_data = np.zeros((s, 2), np.uint32)
        self.temperature = np.zeros(s, np.float32)
        self.top_p = np.ones(s, np.float32)
        self.top_k = np.zeros(s, np.int32)
        self.occupied = np.zeros(s, bool)
        self._seed_counter = 0
        # Step variants by rows covered: 1, 2, 4, … and S (``bucket_rows=False``: always S); under data
        # parallelism only multiples of the data groups, so every device keeps its own rows.
        buckets = [1 << i for i in range(s.bit_length()) if (1 << i) < s and (1 << i) % dp == 0] if bucket_rows else []
        self.row_buckets = buckets + [s]

    def _init_caches(self) -> None:
        s, capacity = self.num_slots, self.capacity
        with use_mesh(self.mesh):
            cache = tgt.init_cache(self.target, s, capacity)
            dstate = dr.init_draft_cache(self.drafter, s, capacity) if self.drafter is not None else None
            # Distinct buffers per leaf (init_draft_cache shares one zeros array between k and v): donation
            # needs every leaf to own its buffer.
            self.cache, self.dstate = jax.tree.map(lambda x: jnp.array(x, copy=True), (cache, dstate))

    def reset(self) -> None:
        """Drop every slot and rebuild the caches (after a failed step, whose donated buffers are gone)."""
        self._init_caches()
        self.running[:] = False
        self.occupied[:] = False
        self.remaining[:] = 0

    # -- slots
    def free_slot(self) -> int | None:
        free = np.flatnonzero(~self.occupied)
        return int(free[0]) if free.size else None

    def num_running(self) -> int:
        return int(self.running.sum())

    def rows_for(self, highest: int) -> int:
        """The smallest row bucket (power of two, or all slots) covering slots ``[0, highest)``."""
        return next(b for b in self.row_buckets if b >= highest)

    def verify_len_for(self, batch: int) -> int:
        sizes = sorted(self.verify_lengths)
        below = [b for b in sizes if b <= batch]
        return self.verify_lengths[below[-1] if below else sizes[0]]

    def _key(self, seed: int | None) -> np.ndarray:
        if seed is None:
            self._seed_counter += 1
            seed = (0x5EED << 20) + self._seed_counter
        return np.asarray(jax.random.key_data(jax.random.key(int(seed) & 0xFFFFFFFF)), np.uint32)

    def add(self, slot: int, prompt: Sequence[int], max_new_tokens: int, params: SlotParams) -> tuple[int, str | None]:
        """Prefill ``prompt`` into ``slot``; returns the first token and a finish reason if it already ended."""
        prompt = list(prompt)
        n = len(prompt)
        if n < 1 or n + max_new_tokens > self.context_length + 1 or max_new_tokens < 1:
            raise ValueError(f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds the context")
        key = self._key(params.seed)
        k_prefill, k_loop = jax.random.split(jax.random.wrap_key_data(key))
        sampling = (jax.random.key_data(k_prefill), jnp.float32(params.temperature), jnp.float32(params.top_p),
                    jnp.int32(params.top_k))
        with use_mesh(self.mesh):
            for offset, width in plan_prefill(n, self.prompt_widths, self.capacity):
                chunk = prompt[offset : offset + width]
                tokens = np.full((1, width), self.target.config.pad_token_id or 0, np.int32)
                tokens[0, : len(chunk)] = chunk
                self.cache, self.dstate, first = prefill_slot(
                    self.target, self.drafter, self.cache, self.dstate, jnp.asarray(tokens), jnp.int32(len(chunk)),
                    jnp.int32(slot), jnp.bool_(offset == 0), *sampling,
                )
        first = int(first)
        self.occupied[slot] = True
        self.anchor[slot] = first
        self.remaining[slot] = max_new_tokens - 1
        self.key_data[slot] = np.asarray(jax.random.key_data(k_loop))
        self.temperature[slot] = params.temperature
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        reason = "stop" if first in self.stop_set else "length" if max_new_tokens <= 1 else None
        self.running[slot] = reason is None
        return first, reason

    def release(self, slot: int) -> None:
        """Free ``slot`` at once (finished, cancelled or failed)."""
        self.running[slot] = False
        self.occupied[slot] = False
        self.remaining[slot] = 0
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = 0.0, 1.0, 0
        with use_mesh(self.mesh):
            self.cache, self.dstate = reset_slot(self.cache, self.dstate, jnp.int32(slot))

    def step(self) -> StepResult:
        active = self.running.copy()
        n = int(active.sum())
        if n == 0:
            return StepResult({}, {}, [], 0)
        t = self.verify_len_for(n)
        r = self.rows_for(int(np.flatnonzero(active)[-1]) + 1)
        with use_mesh(self.mesh):
            self.cache, self.dstate, emitted, n_keep, _, hit_stop, key_next = step(
                self.target, self.drafter, self.cache, self.dstate, jnp.asarray(self.anchor[:r]), jnp.asarray(active[:r]),
                jnp.asarray(self.remaining[:r]), jnp.asarray(self.key_data[:r]), jnp.asarray(self.temperature[:r]),
                jnp.asarray(self.top_p[:r]), jnp.asarray(self.top_k[:r]), self.stop_ids, verify_len=t, rows=r,
            )
        emitted, n_keep, hit_stop, key_next = jax.device_get((emitted, n_keep, hit_stop, key_next))
        self.key_data[:r] = np.asarray(key_next, np.uint32)
        tokens, finished, accepted = {}, {}, []
        for i in np.flatnonzero(active):
            i = int(i)
            k = int(n_keep[i])
            new = [int(x) for x in emitted[i, :k]]
            tokens[i] = new
            accepted.append(k)
            if k:
                self.anchor[i] = new[-1]
            self.remaining[i] -= k
            if hit_stop[i]:
                finished[i] = "stop"
            elif self.remaining[i] <= 0:
                finished[i] = "length"
            if i in finished:
                self.running[i] = False
        return StepResult(tokens, finished, accepted, n)

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile every step variant (verify lengths × row buckets) and prefill at every prompt width."""
        bos = self.target.config.bos_token_id or 1
        for width in self.prompt_widths:
            if progress:
                progress(f"compiling prefill (prompt width {width})")
            self.add(0, [bos] * min(width, self.context_length), 1, SlotParams())
            self.release(0)
        for t in sorted(set(self.verify_lengths.values())):
            for rows in self.row_buckets:
                if progress:
                    progress(f"compiling step (verify length {t}, {rows} rows)")
                slot = rows - 1
                self.add(slot, [bos], 2, SlotParams())
                table, self.verify_lengths = self.verify_lengths, {1: t}
                try:
                    self.step()
                finally:
                    self.verify_lengths = table
                self.release(slot)
