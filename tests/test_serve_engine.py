"""The serving engine without HTTP: continuous batching equals ``generate`` (AR and speculative, with
multi-token acceptance from an oracle drafter), per-row logits processing, per-row lossless sampling."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.experimental import io_callback

from dspine_jax.decoding.accept import accept_sampling
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import COST_SAMPLES
from dspine_jax.decoding.proposers import OracleProposer
from dspine_jax.drafters.drafter import DraftOutput
from dspine_jax.drafters.io import init_drafter
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.models.sampling import Sampling, process_logits, process_rows
from dspine_jax.models.target import load_target
from dspine_jax.serve import engine as eng
from dspine_jax.serve.engine import EngineCore, SlotParams

PROMPTS = [[1, 5, 9, 3], [1, 7, 8, 9, 10, 11, 12], [1, 20], [1, 3, 3, 3, 3, 4], [1, 50, 60], [1, 99, 98, 97, 96]]
BUDGETS = [20, 9, 1, 20, 9, 20]


def run_engine(core: EngineCore, prompts, budgets, params=None, on_admit=None, arrivals=None, log=None):
    """Drive the core as the server's scheduler does: each iteration admits the requests that have arrived
    (request ``r`` at iteration ``arrivals[r]``, default 0, in order) into free slots, runs one prefill call,
    then one step (one round while prompts are being prefilled); finished slots are freed.
    ``on_admit(slot, request)`` is called just before a request is admitted. ``log`` gets one entry per
    iteration: (slots still being prefilled, slots that got tokens from the step)."""
    arrivals = arrivals or [0] * len(prompts)
    outs, pending, slot_req, reasons, taus = {}, list(range(len(prompts))), {}, {}, []
    iteration = 0
    while pending or slot_req:
        while pending and arrivals[pending[0]] <= iteration and core.free_slot() is not None:
            r = pending.pop(0)
            slot = core.free_slot()
            if on_admit:
                on_admit(slot, r)
            core.admit(slot, prompts[r], budgets[r], (params or {}).get(r, SlotParams()))
            slot_req[slot] = r
        for slot, (first, reason) in core.prefill().items():
            outs[slot_req[slot]] = [first]
            if reason:
                reasons[slot_req.pop(slot)] = reason
                core.release(slot)
        result = core.step(rounds=1 if core.num_prefilling() else None)
        taus += result.accepted
        for slot, tokens in result.tokens.items():
            outs[slot_req[slot]] += tokens
        for slot, reason in result.finished.items():
            reasons[slot_req.pop(slot)] = reason
            core.release(slot)
        if log is not None:
            log.append((set(core.prefilling), {s for s, t in result.tokens.items() if t}))
        iteration += 1
    return [outs[i] for i in range(len(prompts))], [reasons[i] for i in range(len(prompts))], taus


def spy_prefill(monkeypatch) -> list[tuple[int, int]]:
    """The ``(rows, width)`` of every prefill call from now on."""
    calls, real = [], eng.prefill_rows

    def spy(target, proposer, rows, prows, tokens, *args):
        calls.append(tuple(tokens.shape))
        return real(target, proposer, rows, prows, tokens, *args)

    monkeypatch.setattr(eng, "prefill_rows", spy)
    return calls


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_target(tiny_models["llama"][0])


def reference(target, stop_ids):
    out = [generate(target, [p], b, stop_ids=stop_ids) for p, b in zip(PROMPTS, BUDGETS)]
    return [r.token_ids[0] for r in out], [r.finish_reasons[0] for r in out]


def test_autoregressive_engine_equals_generate(llama):
    ref, _ = reference(llama, [])
    core = EngineCore(llama, None, num_slots=3, context_length=64, stop_ids=[])
    got, reasons, _ = run_engine(core, PROMPTS, BUDGETS)
    assert got == ref
    assert reasons == ["length"] * len(PROMPTS)


def test_speculative_engine_random_drafter_equals_generate(llama):
    ref, _ = reference(llama, [])
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    # An sps table: verify length 4 with one running request, 2 with two or more (both paths run).
    core = EngineCore(llama, drafter, num_slots=3, context_length=64, stop_ids=[], sps_table={1: 4, 2: 2})
    assert (core.verify_len_for(1), core.verify_len_for(3), core.max_verify) == (4, 2, 4)
    got, _, _ = run_engine(core, PROMPTS, BUDGETS)
    assert got == ref


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest sets 8 CPU devices)")
def test_sharded_engine_equals_generate(llama):
    """``serve --tp 2 --dp 2``: the engine on a 2×2 mesh (slots split over data, heads over model)."""
    from dspine_jax.parallel.mesh import make_mesh

    ref, _ = reference(llama, [])
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    mesh = make_mesh(tp=2, dp=2)
    with pytest.raises(ValueError, match="multiple of 2"):
        EngineCore(llama, drafter, num_slots=3, context_length=64, mesh=mesh)
    core = EngineCore(llama, drafter, num_slots=4, context_length=64, stop_ids=[], mesh=mesh)
    assert core.row_buckets == [2, 4]
    assert core.cache.k[0].sharding.spec[0] == "data"
    got, _, _ = run_engine(core, PROMPTS, BUDGETS)
    assert got == ref


def test_speculative_engine_oracle_multi_token(llama):
    """An oracle drafter (the reference continuation, wrong at a slot that varies with position) makes
    rounds commit 1…T tokens; output, stops mid-block and budget cuts must still equal ``generate``."""
    full_ref, _ = reference(llama, [])
    stop_token = full_ref[0][6]  # a token the first row emits mid-way: stop there
    ref, ref_reasons = reference(llama, [stop_token])
    width = 64
    seqs = np.zeros((len(PROMPTS), width), np.int32)
    for i, (p, r) in enumerate(zip(PROMPTS, full_ref)):
        row = p + r
        seqs[i, : len(row)] = row
    seqs = jnp.asarray(seqs)
    mapping = np.zeros(3, np.int32)  # slot → prompt index, read from the host at run time

    @struct.dataclass
    class Oracle(DrafterProposer):
        """The drafter's context ring as state (its lengths = the row's position), the reference as proposals."""

        def propose(self, target, cache, anchor, counts, keys, sampling, num):
            rows = io_callback(lambda: mapping.copy(), jax.ShapeDtypeStruct((3,), jnp.int32))[: cache.lengths.shape[0]]
            pos = cache.lengths[:, None] + 1 + jnp.arange(num)[None, :]
            tokens = jnp.take_along_axis(seqs[rows], jnp.clip(pos, 0, width - 1), axis=1)
            wrong = (cache.lengths % (num + 2))[:, None] == jnp.arange(num)[None, :]
            tokens = jnp.where(wrong, (tokens + 1) % target.config.vocab_size, tokens).astype(jnp.int32)
            return DraftOutput(tokens=tokens, cand_ids=tokens[..., None], q=jnp.ones((*tokens.shape, 1), jnp.float32))

    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=5, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=3, context_length=64, stop_ids=[stop_token], proposer=Oracle(drafter),
                      verify=5)  # fmt: skip

    got, reasons, taus = run_engine(core, PROMPTS, BUDGETS, on_admit=mapping.__setitem__)
    assert got == ref
    assert reasons == ref_reasons
    assert max(taus) == 5 and min(taus) >= 1 and len(set(taus)) >= 3


def decode_one(core: EngineCore, prompt: list[int], budget: int) -> tuple[list[int], list[int]]:
    """One request in slot 0, one round per step: its tokens and the verify length of every round."""
    first, _ = core.add(0, prompt, budget, SlotParams())
    out, seen = [first], []
    while core.running[0]:
        result = core.step(rounds=1)
        out += result.tokens.get(0, [])
        seen += result.verify_lengths
    return out, seen


def test_adaptive_engine_measures_costs_online_and_stays_exact(llama, costs_file):
    """``verify="auto"`` (the default): the first steps of a row bucket run pinned lengths and time them (exact
    all the same); the costs (``decoder.Calibration``) are stored on disk and later engines read them; with costs that make
    drafting pointless the policy settles on plain decode steps."""
    from dspine_jax.decoding import adaptive

    ref = generate(llama, [PROMPTS[0]], 60, stop_ids=[]).token_ids[0]
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=1, context_length=96, stop_ids=[])
    assert core.candidates == (1, 2, 4) and core.max_verify == 4
    out, seen = decode_one(core, PROMPTS[0], 60)
    assert out == ref
    assert set(seen) == {1, 2, 4}  # calibration pinned every length
    (key, stored), = json.loads(costs_file.read_text()).items()
    costs = adaptive.load_cost_entry(key)[0]
    assert "|b1|" in key and set(costs) == {1, 2, 4} and all(v > 0 for v in costs.values())
    assert stored["segments"] == {str(t): COST_SAMPLES for t in (1, 2, 4)}  # live steps timed each length
    again = EngineCore(llama, drafter, num_slots=1, context_length=96, stop_ids=[])
    assert not again.decoder.needs_calibration(1) and again.decoder.costs(1) == costs  # read from disk

    pointless = EngineCore(llama, drafter, num_slots=1, context_length=96, stop_ids=[],
                           verify_costs={1: {1: 1.0, 2: 5.0, 4: 9.0}})  # fmt: skip
    out, seen = decode_one(pointless, PROMPTS[0], 60)
    assert out == ref
    assert seen[0] == 1 and sum(t > 1 for t in seen) <= 3  # only probes draft


def oracle_for(target, references: list[list[int]], accept: list[list[int]], block_limit: int | None = None) -> OracleProposer:
    """An ``OracleProposer`` whose row (slot) b proposes ``references[b]`` (its generated tokens), right for
    ``accept[b][r]`` proposals in the row's round r, then wrong; ``block_limit``: as a drafter's block."""
    width = max(map(len, references))
    ref = np.zeros((len(references), width), np.int32)
    for b, row in enumerate(references):
        ref[b, : len(row)] = row
    return OracleProposer(reference=jnp.asarray(ref), accept=jnp.asarray(accept, jnp.int32),
                          vocab_size=target.config.vocab_size, block_limit=block_limit)  # fmt: skip


def test_engine_runs_an_oracle_proposer_as_is(llama):
    """The engine drives any proposer through the protocol: an ``OracleProposer`` (state: a round counter per
    row; proposals read at the row's token count, which the engine keeps on the device) makes rounds commit
    1…5 tokens by schedule, and the output still equals ``generate``'s."""
    prompts, budgets = PROMPTS[:3], [20, 9, 15]
    ref = [generate(llama, [p], b, stop_ids=[]).token_ids[0] for p, b in zip(prompts, budgets)]
    accept = [[0, 4, 1, 3, 2], [4, 4, 0, 2, 1], [1, 0, 3, 4, 2]]
    core = EngineCore(llama, None, num_slots=3, context_length=64, stop_ids=[], verify=5,
                      proposer=oracle_for(llama, ref, accept))  # fmt: skip
    assert core.max_verify == 5  # (no drafter: the oracle has no block limit; the fixed length is 5)
    got, reasons, taus = run_engine(core, prompts, budgets)
    assert got == ref and reasons == ["length"] * 3
    assert max(taus) == 5 and {1, 2, 3, 4} <= set(taus)


def test_adaptive_engine_greedy_probes_peek(llama):
    """Where drafting looks too dear on the prior alone, a greedy slot's first probe is a peek (a plain round
    whose one-token draft is compared with the emitted token): an always-right drafter is found by it and the
    slot verifies 4 tokens from the next step on; no probe verifies 2. A sampled slot probes at T = 2."""
    from dspine_jax.decoding import adaptive

    ref = generate(llama, [PROMPTS[0]], 40, stop_ids=[]).token_ids[0]
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    oracle = oracle_for(llama, [ref], [[99]], block_limit=4)  # always right, a block of 4 like the drafter's
    dear = {1: {1: 1.0, 2: 1.9, 4: 2.2}}  # at the prior (a coin flip per slot) T = 1 pays best
    core = EngineCore(llama, drafter, num_slots=1, context_length=96, stop_ids=[], proposer=oracle, verify_costs=dear)
    out, seen = decode_one(core, PROMPTS[0], 40)
    assert out == ref
    first = next(r for r, t in enumerate(seen) if t > 1)
    assert seen[:first] == [1] * first and first == adaptive.FIRST_WAIT + 1, seen
    assert seen[first:-1] == [4] * (len(seen) - first - 1), seen  # (the last round may be cut by the budget)

    sampled = EngineCore(llama, drafter, num_slots=1, context_length=96, stop_ids=[], proposer=oracle, verify_costs=dear)
    sampled.add(0, PROMPTS[0], 40, SlotParams(temperature=0.7, seed=1))
    seen = []
    while sampled.running[0]:
        seen += sampled.step(rounds=1).verify_lengths
    assert seen[: adaptive.FIRST_WAIT + 1] == [1] * adaptive.FIRST_WAIT + [2], seen


def test_process_rows_matches_per_row():
    logits = jax.random.normal(jax.random.key(0), (4, 3, 50)) * 3
    temperature = jnp.asarray([0.7, 1.0, 1.3, 2.0])
    top_p = jnp.asarray([1.0, 0.8, 0.5, 1.0])
    top_k = jnp.asarray([0, 5, 0, 12])
    got = process_rows(logits, Sampling(temperature, top_p, top_k))
    for b in range(4):
        want = process_logits(logits[b], temperature[b], top_p[b], int(top_k[b]))
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want), rtol=1e-6)


def test_accept_sampling_with_per_row_parameters_is_lossless():
    """First emitted token of a round ~ p (temperature/top-k applied), whatever the draft q."""
    v, n = 6, 20000
    logits = jnp.asarray([[[2.0, 1.0, 0.5, 0.0, -1.0, -2.0], [0.0, 0.3, 0.2, 0.1, 0.0, 0.0]]])  # [1, T=2, V]
    temperature, top_p, top_k = jnp.asarray([0.8]), jnp.asarray([1.0]), jnp.asarray([4])
    cand = jnp.asarray([[[1, 3, 0]]], jnp.int32)  # [1, P=1, C=3]
    q = jnp.asarray([[[0.5, 0.3, 0.2]]], jnp.float32)

    def one(key):
        kd, ka = jax.random.split(key)
        idx = jax.random.categorical(kd, jnp.log(q[0, 0]))
        tok = cand[0, 0, idx][None, None]
        emitted, _ = accept_sampling(ka[None], logits, DraftOutput(tokens=tok, cand_ids=cand, q=q),
                                     Sampling(temperature, top_p, top_k))
        return emitted[0, 0]

    first = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(1), n))
    freq = np.bincount(np.asarray(first), minlength=v) / n
    p = np.asarray(jax.nn.softmax(process_logits(logits[0, 0], 0.8, 1.0, 4)))
    np.testing.assert_allclose(freq, p, atol=0.015)


def test_speculative_engine_hybrid_target(tmp_path):
    """Qwen3.5-style hybrid target (GDN state per slot, replayed on partial accepts): slots prefilled
    into a shared cache and stepped together still equal ``generate``."""
    from test_hybrid import make_tiny_hybrid

    target = load_target(make_tiny_hybrid("qwen3_5_text", tmp_path / "q35", seed=0)[0])
    prompts, budgets = PROMPTS[:4], [12, 5, 12, 9]
    ref = [generate(target, [p], b, stop_ids=[]).token_ids[0] for p, b in zip(prompts, budgets)]
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=3, top_k=8, seed=5)
    core = EngineCore(target, drafter, num_slots=2, context_length=64, stop_ids=[], bucket_rows=False)
    got, _, _ = run_engine(core, prompts, budgets)
    assert got == ref


@pytest.mark.parametrize("context,max_bucket,verify", [(40, 256, 1), (64, 32, 4), (1000, 256, 16), (2048, 256, 1),
                                                         (20, 256, 1), (1100, 300, 8)])
def test_plan_prefill_covers_every_prompt_with_compiled_widths(context, max_bucket, verify):
    widths = eng.prompt_widths(context, max_bucket)
    capacity = eng.cache_capacity(context, verify)
    assert widths[0] == eng.MIN_PROMPT_BUCKET and all(b == 2 * a for a, b in zip(widths, widths[1:]))
    assert widths[-1] <= max(max_bucket, eng.MIN_PROMPT_BUCKET) and capacity >= context + verify
    for n in range(1, context + 1):
        plan = eng.plan_prefill(n, widths, capacity)
        assert [o for o, _ in plan] == [0] + list(np.cumsum([w for _, w in plan[:-1]]))  # contiguous chunks
        assert all(w in widths for _, w in plan) and plan[-1][0] < n <= plan[-1][0] + plan[-1][1] <= capacity
        assert len(plan) <= -(-n // widths[-1]) + len(widths)  # long prompts: mostly full chunks


def test_long_prompts_are_chunked_and_equal_generate(llama):
    """Prompts wider than the widest prefill (32) run in chunks of compiled widths, two prompts per call
    (``prefill_chunk`` 64); prompts admitted while another request decodes go in chunk by chunk between its
    steps (the last one also arrives late). Output equals ``generate`` and nothing new is compiled after
    warmup."""
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=2, context_length=120, stop_ids=[], max_prompt_bucket=32,
                      prefill_chunk=64)  # fmt: skip
    core.warmup()
    compiled = eng.serving_programs(core)
    prompts = [[1] + [(7 * i + 3) % 120 + 3 for i in range(n)] for n in (100, 33, 64, 70)]
    budgets = [12, 30, 12, 12]  # the second request decodes while the third and fourth are prefilled
    ref = [r[:b] for r, b in zip(generate(llama, prompts, 30, stop_ids=[]).token_ids, budgets)]  # one compile
    log = []
    got, _, _ = run_engine(core, prompts, budgets, arrivals=[0, 0, 0, 4], log=log)
    assert got == ref
    assert eng.serving_programs(core) == compiled
    interleaved = [prefilling for prefilling, decoded in log if prefilling and decoded - prefilling]
    assert len(interleaved) >= 4  # iterations that prefilled a chunk and decoded another slot


def test_long_prompts_are_chunked_on_a_hybrid_target(tmp_path):
    """GDN conv windows and recurrent states carry over from one prefill chunk to the next, per row of a
    batched call (two prompts × 32 tokens); then a prompt extending a finished row (a prefix-cache hit)
    shares its calls with a fresh one. Output equals ``generate``."""
    from test_hybrid import make_tiny_hybrid

    target = load_target(make_tiny_hybrid("qwen3_5_text", tmp_path / "q35", seed=0)[0])
    core = EngineCore(target, None, num_slots=2, context_length=120, stop_ids=[], max_prompt_bucket=32,
                      prefill_chunk=64, prefix_cache_bytes=1 << 30)  # fmt: skip
    first = [[1] + [(5 * i + 2) % 100 + 3 for i in range(n)] for n in (75, 40)]
    got, _, _ = run_engine(core, first, [8, 8])
    extended = first[0] + got[0][:-1] + [7, 8, 9]  # extends the first row whole (its last token was never fed)
    fresh = [1] + [(3 * i + 1) % 90 + 3 for i in range(50)]
    again, _, _ = run_engine(core, [extended, fresh], [8, 8])
    assert got + again == generate(target, first + [extended, fresh], 8, stop_ids=[]).token_ids
    assert core.prefix_stats().hits == 1


@pytest.mark.parametrize("kind", [None, "dspine"])
def test_hybrid_prompts_sharing_a_head_start_from_its_last_chunk_snapshot(tmp_path, kind):
    """A hybrid row is usable only whole, so prompts that share a head but not the rest would share nothing;
    the snapshots kept after each prefill chunk let the second prompt start from the last chunk boundary
    inside the shared head (and its drafter context from the same point). Output equals ``generate``'s."""
    from test_hybrid import make_tiny_hybrid

    target = load_target(make_tiny_hybrid("qwen3_5_text", tmp_path / "q35", seed=0)[0])
    drafter = init_drafter(target, kind, num_layers=1, block_size=4, top_k=8, seed=3) if kind else None
    core = EngineCore(target, drafter, num_slots=1, context_length=160, stop_ids=[], max_prompt_bucket=32,
                      prefill_chunk=32, prefix_cache_bytes=1 << 30)  # fmt: skip
    core.warmup()  # compiles the snapshot copies too: nothing compiles while serving
    compiled = eng.serving_programs(core)
    head = [1] + [(5 * i + 2) % 100 + 3 for i in range(70)]  # 71 tokens: chunk boundaries at 32 and 64
    prompts = [head + [11, 12, 13, 14], head + [21, 22]]
    got, _, _ = run_engine(core, prompts, [6, 6])
    assert got == [generate(target, [p], 6, stop_ids=[]).token_ids[0] for p in prompts]
    assert eng.serving_programs(core) == compiled
    stats = core.prefix_stats()
    assert (stats.lookups, stats.hits, stats.hit_tokens) == (2, 1, 64)
    # The snapshots of the second prompt's own chunks replaced the first one's (same tokens): no duplicates.
    tokens = [tuple(e.tokens) for e in core.prefix_cache.entries.values()]
    assert len(tokens) == len(set(tokens))


def test_plan_batch_fills_the_budget_with_rows_whose_chunk_fits():
    widths, sizes = [32, 64, 128, 256], [1, 2, 4, 8]
    # Eight short prompts (40 tokens → width 64): four share a 256-token call, none is a padding row.
    assert eng.plan_batch([(0, 40)] * 8, widths, 256, 256, sizes) == (64, [0, 1, 2, 3])
    assert eng.plan_batch([(0, 40)] * 3, widths, 256, 256, sizes) == (64, [0, 1])
    # A long prompt first: one full chunk of the widest width; a row whose committed tokens leave no room
    # for the width waits for a later call.
    assert eng.plan_batch([(0, 900), (10, 5)], widths, 512, 1024, sizes) == (256, [0, 1])
    assert eng.plan_batch([(0, 40), (200, 40), (10, 900)], widths, 128, 256, sizes) == (64, [0, 2])
    rng = np.random.default_rng(0)
    for _ in range(300):
        capacity, budget = int(rng.choice([128, 256, 1024])), int(rng.choice([32, 64, 100, 256, 512]))
        pending = []
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(1, capacity - 31))
            done = min(int(rng.integers(0, n // 32 + 1)) * 32, n - 1)
            pending.append((done, n - done))
        width, picked = eng.plan_batch(pending, widths, budget, capacity, sizes)
        assert width in widths and width <= budget and picked[0] == 0 and len(picked) in sizes
        assert len(picked) * width <= budget and all(pending[i][0] + width <= capacity for i in picked)
        assert picked == sorted(set(picked))


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_requests_arriving_together_prefill_in_one_call(llama, monkeypatch, prefix_cache):
    """Four requests arriving at once prefill in one call (4 rows × 32 tokens = the 128-token budget); the
    ones admitted later join requests mid-decode. With the prefix cache on, later prompts start from
    finished rows (the shared first token) and share calls with fresh ones. Output equals ``generate``."""
    ref, _ = reference(llama, [])
    calls = spy_prefill(monkeypatch)
    core = EngineCore(llama, None, num_slots=4, context_length=64, stop_ids=[], prefill_chunk=128,
                      prefix_cache_bytes=(1 << 30) * prefix_cache)  # fmt: skip
    got, _, _ = run_engine(core, PROMPTS, BUDGETS)
    assert got == ref
    assert calls[0] == (4, 32)
    if prefix_cache:
        assert core.prefix_stats().hits >= 2


def test_cache_capacity_follows_the_longest_request(llama):
    """With a context far above what the requests use, the caches hold a capacity bucket just above the
    occupied slots' positions: 128 while every row is short, 256 once one passes 128, back to 128 when
    it leaves. Output equals ``generate``'s, and warmup compiled every step (none compiles while serving).
    (One kind: every kind's context ring is the same ``DraftCache``; block 2, so verify lengths 1 and 2 only,
    and one slot, so one row bucket: the warmup compiles every program at three capacities.)"""
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=2, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=1, context_length=500, stop_ids=[], max_prompt_bucket=64)
    assert core.capacity_buckets == [128, 256, core.capacity]
    core.warmup()
    assert (core.rows, core.cache_capacity) == (1, 128)
    compiled = eng.serving_programs(core)
    seen = []
    step = core.step

    def spy(rounds=None):
        out = step(rounds)
        seen.append(core.cache_capacity)
        return out

    core.step = spy
    prompts = [[1] + [(7 * i + 3) % 120 + 3 for i in range(n)] for n in (100, 20, 30)]
    budgets = [40, 40, 20]
    ref = [generate(llama, [p], b, stop_ids=[]).token_ids[0] for p, b in zip(prompts, budgets)]
    got, _, _ = run_engine(core, prompts, budgets)
    assert got == ref
    assert seen[0] == 128 and 256 in seen and seen[-1] == 128 and core.capacity not in seen
    assert core.pstate.ring.capacity == core.cache_capacity  # the drafter's ring moved with the target's cache
    assert eng.serving_programs(core) == compiled


def _multi_turn(turns: int, first_len: int = 20, answer: int = 6, message: int = 5) -> list[tuple[list[int], int]]:
    """(prompt, budget) per turn of a replayed transcript: each prompt = the previous prompt + its answer
    (filled in by the caller) + a new user message."""
    rng = np.random.default_rng(4)
    return [(rng.integers(3, 120, first_len if t == 0 else message).tolist(), answer) for t in range(turns)]


def run_multi_turn(core: EngineCore, turns) -> tuple[list[list[int]], list[list[int]]]:
    """Play the transcript through the engine; → (prompts, answers) per turn."""
    prompts, answers, transcript = [], [], []
    for message, budget in turns:
        prompt = transcript + message
        got, _, _ = run_engine(core, [prompt], [budget])
        prompts.append(prompt)
        answers.append(got[0])
        transcript = prompt + got[0]
    return prompts, answers


@pytest.mark.parametrize("kind", ["dspine", None])
def test_prefix_cache_multi_turn_reuses_rows_and_equals_generate(llama, kind):
    """Each turn's prompt extends the last one's prompt + answer: from the second turn on, the prompt starts
    from the cached row (only the new tokens are prefilled), and the greedy text equals ``generate``'s and
    that of an engine without the cache."""
    drafter = init_drafter(llama, kind, num_layers=1, block_size=4, top_k=8, seed=3) if kind else None
    turns = _multi_turn(5)
    cached = EngineCore(llama, drafter, num_slots=2, context_length=200, stop_ids=[], prefix_cache_bytes=1 << 30)
    plain = EngineCore(llama, drafter, num_slots=2, context_length=200, stop_ids=[])
    prompts, answers = run_multi_turn(cached, turns)
    assert run_multi_turn(plain, turns) == (prompts, answers)
    assert answers == [generate(llama, [p], b, stop_ids=[]).token_ids[0] for p, (_, b) in zip(prompts, turns)]
    stats = cached.prefix_stats()
    assert stats.lookups == 5 and stats.hits == 4
    # Every hit reused the whole previous prompt + answer but its last token (never fed to the cache).
    assert stats.hit_tokens == sum(len(p) + len(a) - 1 for p, a in zip(prompts[:-1], answers[:-1]))
    assert stats.entries == 1  # each turn's row replaced the one it extends


def test_prefix_cache_truncates_dense_rows_and_keeps_hybrid_rows_whole(tmp_path, llama):
    """A prompt that shares only part of a finished row: a dense target keeps that part; a hybrid target
    (GDN state at the row's end only) uses an entry only when the prompt extends all of it."""
    from test_hybrid import make_tiny_hybrid

    base = list(range(3, 40))
    branch = base[:25] + [90, 91, 92]
    for target, truncatable in ((llama, True), (load_target(make_tiny_hybrid("qwen3_5_text", tmp_path / "q", seed=0)[0]), False)):
        core = EngineCore(target, None, num_slots=1, context_length=120, stop_ids=[], prefix_cache_bytes=1 << 30)
        got, _, _ = run_engine(core, [base, branch], [4, 4])
        assert got == [generate(target, [p], 4, stop_ids=[]).token_ids[0] for p in (base, branch)]
        stats = core.prefix_stats()
        assert (stats.hits, stats.hit_tokens) == ((1, 25) if truncatable else (0, 0))
        hits = stats.hits
        extended = base + got[0][:-1] + [77, 78]  # extends the first row whole (its last token was never fed)
        again, _, _ = run_engine(core, [extended], [4])
        assert again[0] == generate(target, [extended], 4, stop_ids=[]).token_ids[0]
        assert core.prefix_stats().hits == hits + 1


def test_prefix_cache_evicts_least_recently_used_under_its_budget(llama):
    core = EngineCore(llama, None, num_slots=1, context_length=120, stop_ids=[], prefix_cache_bytes=1 << 30)
    run_engine(core, [[5, 6, 7, 8]], [3])
    one = core.prefix_stats().bytes
    core.prefix_cache.budget = int(2.5 * one)
    run_engine(core, [[9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]], [3, 3, 3])
    stats = core.prefix_stats()
    assert stats.entries == 2 and stats.evictions == 2 and stats.bytes <= core.prefix_cache.budget
    firsts = [int(e.tokens[0]) for e in core.prefix_cache.entries.values()]
    assert firsts == [13, 17]  # the two most recent
