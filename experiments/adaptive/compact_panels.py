"""What packing a bfloat16 checkpoint's matrices in bfloat16 saves (``models/panels.py``): the shipped DSpine drafter
(stored in bfloat16, loaded as float32) with its panels in bfloat16, as ``load_draft`` packs them now, against the
same panels widened to float32 (as packed before). The products are the same bits either way (checked here on
the drafts); the pieces of a drafted round that read the drafter's matrices are timed interleaved, medians.

    python experiments/adaptive/compact_panels.py [--draft checkpoints/smollm2-135m-dspine-b8] [--repeats 60]

``--target`` also times our AR decode with a stand-in for a target stored in bfloat16: SmolLM2's weights rounded to
bfloat16 values (what a bfloat16 checkpoint loaded as float32 holds), packed in bfloat16 against the same values in
float32 panels (identical tokens checked).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.bench import interleaved_median_ms, machine_info
from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models import panels
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import QUANTIZED_MATRICES

ROOT = Path(__file__).resolve().parents[2]


def is_packed(x) -> bool:
    return isinstance(x, panels.PanelWeight)


def panel_megabytes(tree) -> float:
    return sum(w.panels.nbytes for w in jax.tree.leaves(tree, is_leaf=is_packed) if is_packed(w)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--target", action="store_true", help="also time AR decode of a target holding bfloat16 values")
    args = ap.parse_args()
    target = tgt.load_target(args.model)
    compact = as_proposer(load_draft(args.draft, target))
    forms = {"bfloat16 panels": compact, "float32 panels": panels.widen_params(compact)}
    n = args.context
    tokens = jnp.asarray([list(range(100, 100 + n))], jnp.int32)
    _, state, first = spec.prefill(target, compact, tokens, jnp.asarray([n], jnp.int32), jax.random.key(0),
                                   jnp.float32(1.0), jnp.float32(1.0), capacity=n + 64, top_k=0, greedy=True)
    keys, sampling = jax.random.split(jax.random.key(1), 1), Sampling.rows(1)
    propose = jax.jit(lambda pr, s, a, k, num: pr.propose(target, s, a, jnp.ones((1,), jnp.int32), k, sampling, num),
                      static_argnums=4)  # fmt: skip
    tapped = jnp.zeros((len(compact.taps), 1, 8, target.config.hidden_size), jnp.float32)
    append = jax.jit(lambda pr, s, x: pr.flush(target, pr.commit(target, s, None, x, jnp.asarray([8]))))
    drafts = {name: jax.device_get(propose(pr, state, first, keys, 7)) for name, pr in forms.items()}
    same = all(np.array_equal(d.tokens, drafts["bfloat16 panels"].tokens) and np.array_equal(d.q, drafts["bfloat16 panels"].q)
               for d in drafts.values())  # fmt: skip
    calls = {}
    for name, pr in forms.items():
        for num in (3, 7):
            calls[f"whole draft, {num} proposals, {name}"] = lambda pr=pr, num=num: propose(pr, state, first, keys, num)
        calls[f"context append (8 tokens), {name}"] = lambda pr=pr: append(pr, state, tapped)
    ms = interleaved_median_ms(calls, args.repeats)
    print(f"{machine_info()}; context {n}; medians of {args.repeats}, interleaved; drafts identical: {same}")
    for name, pr in forms.items():
        print(f"{name}: {panel_megabytes(pr):.1f} MB of packed matrices")
    for name, value in ms.items():
        print(f"{name:52s} {value:7.3f} ms")
    if args.target:
        rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x,
                               panels.unpack_params(target.params))  # fmt: skip
        bf16_target = target.replace(params=panels.pack_params(rounded, QUANTIZED_MATRICES))
        targets = {"bfloat16 panels": bf16_target, "float32 panels": panels.widen_params(bf16_target)}
        runs = {name: generate(t, tokens.tolist(), 64, stop_ids=[]) for name, t in targets.items()}
        same = len({str(r.token_ids) for r in runs.values()}) == 1
        steps = {name: lambda t=t: generate(t, tokens.tolist(), 64, stop_ids=[]).decode_seconds for name, t in targets.items()}
        repeats = max(args.repeats // 10, 3)
        times = {name: [] for name in steps}
        for _ in range(repeats):
            for name, f in steps.items():
                times[name].append(f() / 63 * 1e3)
        print(f"a target holding bfloat16 values (SmolLM2 rounded), our AR decode, 64 tokens, medians of {repeats}, "
              f"interleaved; tokens identical: {same}")  # fmt: skip
        for name, t in targets.items():
            print(f"{name}: {panel_megabytes(t.params):.1f} MB of packed matrices, "
                  f"{np.median(times[name]):.2f} ms per decode step")


if __name__ == "__main__":
    main()
