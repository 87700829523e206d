"""The serving engine's programs: compiled once per shape (single-flight across threads), bounded (least
recently used dropped, memory maps given back), failures that leave the caller's buffers intact; warmup that
serves early (lazy), bounded whatever the buckets, and a compile failure that fails only its request."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import missing_reference

from dspine_jax import init_drafter
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.serve import engine as eng
from dspine_jax.serve import programs as prog
from dspine_jax.serve.engine import EngineCore, SlotParams
from dspine_jax.serve.programs import ProgramError, Programs, program


@program(donate=("x",))
def _chain(x, w, *, depth: int):
    for i in range(depth):
        x = jnp.tanh(x @ w + i) * jnp.sin(x)
    return x


def _args(n: int = 16):
    return jnp.ones((4, n), jnp.float32), jnp.full((n, n), 0.01, jnp.float32)


def test_programs_compile_once_per_shape_and_static_arguments():
    programs = Programs(max_programs=None)
    x, w = _args()
    y = programs.run(_chain, x, w, depth=2)
    assert x.is_deleted()  # donated
    np.testing.assert_allclose(np.asarray(y), np.asarray(_chain(*_args(), depth=2)), rtol=1e-6)
    programs.run(_chain, *_args(), depth=2)
    assert (programs.stats.compiles, programs.stats.hits) == (1, 1)
    programs.run(_chain, *_args(), depth=3)  # other static arguments
    programs.run(_chain, *_args(32), depth=2)  # other shapes
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _args(8)]
    assert not programs.ready(_chain, abstract, {"depth": 2})
    programs.get(_chain, abstract, {"depth": 2})  # ahead of time, from shapes alone
    assert programs.ready(_chain, _args(8), {"depth": 2})  # the concrete call finds it
    assert programs.stats.compiles == len(programs) == 4


def test_compiles_run_with_the_cyclic_collector_paused():
    """Tracing and compiling (the serving engine's ``Programs`` and ``CompileTimer``) run with Python's cyclic
    collector off; it comes back when the last concurrent compile ends, and stays off if the caller had it off."""
    import gc

    from dspine_jax.decoding.planning import CompileTimer, collection_paused

    seen: list[bool] = []

    @program()
    def traced(x, *, k: int):
        seen.append(gc.isenabled())  # runs while tracing
        return x * k

    Programs(max_programs=None).run(traced, jnp.ones(3), k=2)
    CompileTimer().compile(jax.jit(traced, static_argnames="k"), jnp.ones(3), k=3)
    assert seen == [False, False] and gc.isenabled()
    with collection_paused():
        with collection_paused():  # (another thread's compile)
            pass
        assert not gc.isenabled()  # the outer compile is still running
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_programs_evict_the_least_recently_used_and_give_their_memory_maps_back():
    bounded = Programs(max_programs=2)
    for depth in (1, 2, 3):
        bounded.run(_chain, *_args(), depth=depth)
    bounded.run(_chain, *_args(), depth=2)  # now most recent: depth 3's neighbour, depth 1 went first
    assert len(bounded) == 2 and bounded.stats.evictions == 1
    assert bounded.ready(_chain, _args(), {"depth": 2}) and not bounded.ready(_chain, _args(), {"depth": 1})
    bounded.run(_chain, *_args(), depth=1)  # compiled again
    assert bounded.stats.compiles == 4 and not bounded.ready(_chain, _args(), {"depth": 3})

    if prog.memory_maps() is None:
        missing_reference("/proc/self/maps (Linux)")
    deep = [30 + d for d in range(8)]  # distinct programs of ~30 kernels each
    before = prog.memory_maps()
    one = Programs(max_programs=1)
    for depth in deep:
        one.run(_chain, *_args(), depth=depth)
    held_one = prog.memory_maps() - before
    unbounded = Programs(max_programs=None)
    before = prog.memory_maps()
    for depth in deep:
        unbounded.run(_chain, *_args(48), depth=depth)
    held_all = prog.memory_maps() - before
    assert held_all > 4 * max(held_one, 1), (held_one, held_all)

    maps = Programs(max_programs=None, max_maps=prog.memory_maps())  # no room for more maps: keeps one
    for depth in (1, 2, 3):
        maps.run(_chain, *_args(24), depth=depth)
    assert len(maps) == 1 and maps.stats.evictions == 2


def test_concurrent_requests_for_one_program_compile_it_once(monkeypatch):
    programs = Programs(max_programs=None)
    jit = prog._jit

    def slow_jit(*a):
        time.sleep(0.5)  # the first caller is still compiling when the second asks
        return jit(*a)

    monkeypatch.setattr(prog, "_jit", slow_jit)
    results = []
    threads = [threading.Thread(target=lambda: results.append(programs.get(_chain, _args(), {"depth": 4})))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and results[0] is results[1] is results[2]
    assert (programs.stats.compiles, programs.stats.waits) == (1, 2)


def test_a_failed_compile_raises_before_consuming_donated_inputs():
    programs = Programs(max_programs=None)
    programs.fail_next = lambda name: name == "_chain"
    x, w = _args()
    with pytest.raises(ProgramError, match="injected compile failure"):
        programs.run(_chain, x, w, depth=2)
    assert not x.is_deleted() and programs.stats.failures == 1 and len(programs) == 0
    programs.fail_next = None
    y = programs.run(_chain, x, w, depth=2)  # asked again: compiled now
    assert y.shape == (4, 16) and programs.stats.compiles == 1


# ----------------------------------------------------------------------------------------------
# The engine


@pytest.fixture(scope="module")
def llama(tiny_models):
    from dspine_jax.models.target import load_target

    return load_target(tiny_models["llama"][0])


def run(core: EngineCore, prompts, budgets, on_step=None) -> list[list[int]]:
    """Greedy requests admitted as slots free up; ``on_step()`` after every step."""
    out, queue = {}, list(range(len(prompts)))
    owner: dict[int, int] = {}
    while queue or core.num_running() or core.num_prefilling():
        while queue and (slot := core.free_slot()) is not None:
            i = queue.pop(0)
            core.admit(slot, prompts[i], budgets[i], SlotParams())
            owner[slot] = i
            out[i] = []
        for slot, (first, reason) in core.prefill().items():
            out[owner[slot]].append(first)
            if reason:
                core.release(slot)
        result = core.step()
        if on_step:
            on_step()
        for slot, toks in result.tokens.items():
            out[owner[slot]] += toks
        for slot in result.finished:
            core.release(slot)
    return [out[i] for i in range(len(prompts))]


def reference(target, prompts, budgets):
    return [generate(target, [p], b, stop_ids=[]).token_ids[0] for p, b in zip(prompts, budgets)]


PROMPTS = [[1] + [(7 * i + 3) % 120 + 3 for i in range(n)] for n in (100, 20, 9, 40)]


def test_program_count_stays_bounded_across_every_bucket(llama):
    """Requests that move the caches through every row and capacity bucket, on a budget of six
    programs: the engine never holds more, evicts and recompiles instead, and output equals ``generate``'s."""
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=2, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=2, context_length=300, stop_ids=[], max_prompt_bucket=64,
                      max_programs=6)  # fmt: skip
    assert len(core.capacity_buckets) == 2 and core.row_buckets == [1, 2]
    held, buckets = [], set()

    def watch():
        held.append(len(core.programs))
        buckets.add((core.rows, core.cache_capacity))

    alone = run(core, PROMPTS[:1], [60], on_step=watch)  # one row: 128, then 320 positions
    budgets = [60, 50, 8, 30]
    together = run(core, PROMPTS, budgets, on_step=watch)  # two rows
    assert [alone[0]] + together == reference(llama, PROMPTS[:1] + PROMPTS, [60] + budgets)
    assert buckets == {(r, c) for r in core.row_buckets for c in core.capacity_buckets}
    assert max(held) <= 6 and core.programs.stats.evictions > 0


def test_lazy_warmup_serves_at_once_and_compiles_the_rest_in_the_background(llama):
    """``lazy``: only plain decoding at the smallest buckets is compiled before serving; a request served
    right away runs plain rounds where its drafted program is not ready (exact all the same), the background
    compiles the plan in order (wanted programs first), and once it is done no program compiles while
    serving but the resizes between buckets."""
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=2, context_length=120, stop_ids=[], max_prompt_bucket=64)
    plan, minimal = core.warmup_plan()
    assert [p.fn.__name__ for p in plan[:minimal]] == ["reset_slot", "read_rows", "prefill_rows", "write_rows", "step",
                                                      "choose"]  # fmt: skip
    assert plan[minimal - 2].static == {"verify_len": 1, "max_rounds": core.max_rounds, "peek": False}
    names = {p.fn.__name__ for p in plan}
    assert names == {"reset_slot", "read_rows", "prefill_rows", "write_rows", "step", "choose"}
    lines = []
    core.warmup("lazy", progress=lines.append)
    try:
        assert core.programs.stats.compiles >= minimal and core.warmup_progress()["planned"] == len(plan)
        budgets = [10, 12]
        got = run(core, PROMPTS[1:3], budgets)
        assert got == reference(llama, PROMPTS[1:3], budgets)
        deadline = time.time() + 600
        while core.warmup_progress()["pending"] and time.time() < deadline:
            time.sleep(0.5)
        assert core.warmup_progress()["pending"] == 0, "the background warmup did not finish"
        assert any("warmup done" in line for line in lines)
        before = eng.serving_programs(core)
        budgets = [20, 16, 8, 12]
        assert run(core, PROMPTS, budgets) == reference(llama, PROMPTS, budgets)
        assert eng.serving_programs(core) == before
    finally:
        core.close()
    assert not core._warmer.is_alive()


def test_full_warmup_compiles_what_serving_runs(llama):
    """``full`` warmup from abstract shapes produces exactly the programs live calls ask for: serving after
    it compiles nothing but the resizes (``refit``), dense and with sampled requests."""
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=2, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=2, context_length=64, stop_ids=[], max_prompt_bucket=32)
    core.warmup("full")
    plan, _ = core.warmup_plan()
    assert core.programs.stats.compiles == len(plan) == core.warmup_progress()["compiled"]
    before = eng.serving_programs(core)
    for i, temperature in enumerate((0.0, 0.8)):
        core.admit(i, PROMPTS[1 + i][:30], 12, SlotParams(temperature=temperature, seed=i))
    while core.num_prefilling():
        core.prefill()
    while core.num_running():
        for slot in core.step().finished:
            core.release(slot)
    assert eng.serving_programs(core) == before


def test_the_first_choice_of_a_run_is_compiled_by_the_warmup(llama):
    """The policy's first choice of a run (``Decoder.plan``, each time the slots start running again) goes through
    the engine's programs: a ``full`` warmup compiles it once per row bucket, and requests at one and two rows
    (costs given: no calibration, so every run starts with that choice) make it there and compile nothing more.
    Output equals ``generate``'s."""
    drafter = init_drafter(llama, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    core = EngineCore(llama, drafter, num_slots=2, context_length=64, stop_ids=[], max_prompt_bucket=32,
                      verify_costs={1: 1.0, 2: 1.1, 4: 1.2})  # fmt: skip
    core.warmup("full")
    assert core.programs.stats.by_name["choose"] == len(core.row_buckets) == 2
    before = eng.serving_programs(core)
    choices, through = [], core.decoder.run_choice
    core.decoder.run_choice = lambda *args: choices.append(args[1].wait.shape[0]) or through(*args)
    got = run(core, PROMPTS[2:3], [10]) + run(core, PROMPTS[1:3], [12, 8])  # one row, then two
    assert got == reference(llama, PROMPTS[2:3] + PROMPTS[1:3], [10, 12, 8])
    assert set(choices) == set(core.row_buckets)  # each run's first choice, at its row bucket
    assert eng.serving_programs(core) == before


def test_a_compile_failure_fails_its_request_and_the_engine_goes_on(llama):
    """An injected compile failure of the prefill program: ``prefill`` raises with the slots it was
    filling, their caches untouched; the next request (same program, now compiling) is served exactly."""
    core = EngineCore(llama, None, num_slots=2, context_length=64, stop_ids=[])
    core.programs.fail_next = lambda name: name == "prefill_rows"
    core.admit(0, PROMPTS[2], 5, SlotParams())
    with pytest.raises(ProgramError) as failure:
        core.prefill()
    assert failure.value.slots == [0]
    core.release(0)
    core.programs.fail_next = None
    assert run(core, [PROMPTS[2]], [5]) == reference(llama, [PROMPTS[2]], [5])
    assert core.programs.stats.failures == 1


def test_warmup_mode_is_checked(llama):
    core = EngineCore(llama, None, num_slots=1, context_length=64, stop_ids=[])
    with pytest.raises(ValueError, match="full, lazy, none"):
        core.warmup("eager")
    core.warmup("none")
    assert len(core.programs) == 0 and eng.WARMUP_MODES == ("full", "lazy", "none")
