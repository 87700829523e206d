"""Compiled cost of one round-draft, split into backbone, injection and decode head.

    JAX_PLATFORMS=cpu python experiments/drafter_cost.py

Nothing is executed or allocated: every parameter is a ``jax.ShapeDtypeStruct``, each piece is
``jax.jit(...).lower(...).compile().cost_analysis()``-ed. Pieces:

* full      ``draft`` — the one jitted call the speculative loop makes
* backbone  ``forward(..., inject=False)`` — block embedding, L layers against the context, final norm
* injection the L adjacent injections on a ``[B, T, H]`` block (readout, gates, message, write)
* decode    ``decode`` — unary logits over the P slots, top-K, LWR transition table, walk

XLA's cost analysis counts a while-loop body once; the only loop here is the walk (P table look-ups and
choices, no matmul), so the undercount is negligible. Printed as a markdown table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import dspine
from dspine_jax.drafters.config import drafter_config_from_dict
from dspine_jax.drafters.ring import DraftCache
from dspine_jax.models.dense import DenseParams
from dspine_jax.models.family import target_config_from_dict
from dspine_jax.models.target import Target


def sds(shape: tuple[int, ...], dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def abstract_target(cfg: dict, dtype) -> Target:
    """Only the embedding and LM head: the draft never touches the target's layers."""
    c = target_config_from_dict(cfg)
    h, v = c.hidden_size, c.vocab_size
    params = DenseParams(embed=sds((v, h), dtype), layers=(), final_norm=sds((h,), dtype), lm_head=sds((h, v), dtype))
    return Target(params=params, config=c)


def abstract_drafter(cfg: dict, dtype) -> D.Drafter:
    c = drafter_config_from_dict(cfg)
    L, h, nd, kd, f = (
        c.num_layers,
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    )
    layers = tuple(
        D.DrafterLayer(
            input_norm=sds((h,), dtype),
            q=sds((h, nd), dtype),
            k=sds((h, kd), dtype),
            v=sds((h, kd), dtype),
            o=sds((nd, h), dtype),
            q_norm=sds((c.head_dim,), dtype),
            k_norm=sds((c.head_dim,), dtype),
            post_norm=sds((h,), dtype),
            gate=sds((h, f), dtype),
            up=sds((h, f), dtype),
            down=sds((f, h), dtype),
        )
        for _ in range(L)
    )
    params = D.DrafterParams(
        fc=sds((c.num_taps * h, h), dtype),
        hidden_norm=sds((h,), dtype),
        layers=layers,
        norm=sds((h,), dtype),
    )
    if c.kind == "dspine":
        r, m = c.transfer_rank, c.message_size
        injection = dspine.Injection(
            readouts=tuple(sds((h, r), dtype) for _ in range(L)),
            writes=tuple(sds((m, h), dtype) for _ in range(L)),
            message=sds((r, m), dtype),
            receiver_gate=sds((r, m), dtype),
            predecessor_gate=sds((r, m), dtype),
            bias=sds((m,), dtype),
        )
        params = D.with_kind_weights(dspine.DSpineParams, params, injection=injection, transfer_codes=sds((c.vocab_size, r), dtype))
    return D.Drafter(params=params, config=c)


def cost(fn, *args) -> tuple[float, float]:
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax returns one dict per device
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def measure(name: str, target_cfg: dict, drafter_cfg: dict, batch: int, context_slots: int, dtype) -> list[str]:
    target = abstract_target(target_cfg, dtype)
    drafter = abstract_drafter(drafter_cfg, dtype)
    c = drafter.config
    L, t, h = c.num_layers, c.block_size, c.hidden_size
    ring = tuple(sds((batch, c.num_kv_heads, context_slots, c.head_dim), dtype) for _ in range(L))
    cache = DraftCache(k=ring, v=ring, lengths=sds((batch,), jnp.int32))
    anchor, key, temp = sds((batch,), jnp.int32), jax.eval_shape(lambda: jax.random.PRNGKey(0)), sds((), jnp.float32)
    block = sds((batch, t, h), dtype)
    fwd = D.BlockForward(hidden=block, pre_injection=block)

    def injection_only(drafter: D.Drafter, h: jax.Array, anchor: jax.Array) -> jax.Array:
        for layer in range(drafter.config.num_layers):
            h = dspine.SPINE.inject(drafter, layer, h, anchor)
        return h

    def backbone_only(drafter, target, cache, anchor):
        return D.forward(drafter, target, cache, D.block_tokens(drafter, anchor), inject=False).hidden

    rows = [("full draft (one jitted call)", cost(D.draft, drafter, target, cache, anchor, key, temp))]
    rows.append(("backbone", cost(backbone_only, drafter, target, cache, anchor)))
    if c.kind == "dspine":
        rows.append(("injection (all L layers)", cost(injection_only, drafter, block, anchor)))
    head = cost(D.decode, drafter, target, fwd, anchor, key, temp)
    rows.append(("decode head", head))
    total = (sum(r[1][0] for r in rows[1:]), sum(r[1][1] for r in rows[1:]))
    unary = cost(lambda d, tg, h: D.unary_logits(d, tg, h[:, 1:]), drafter, target, block)
    rows.append(("  ↳ unary logits (LM head on P slots, as DFlash)", unary))
    rest = "  ↳ rest: top-K, LWR transition table, walk" if c.kind == "dspine" else "  ↳ rest: softmax / argmax / sampling"
    rows.append((rest, (head[0] - unary[0], head[1] - unary[1])))
    rows.append(("sum of backbone + injection + decode head", total))
    # XLA's cost model charges a gather the whole operand; these two gathers touch a few rows only.
    embed_gather = cost(lambda tg, a: tg.params.embed[D.block_tokens(drafter, a)], target, anchor)[1]
    if c.kind == "dspine":
        cand = sds((batch, t - 1, c.top_k), jnp.int32)
        head_gather = cost(lambda tg, ids: dspine.head_rows(tg.params.lm_head, ids), target, cand)[1]
    if c.kind == "dspine":
        shape = f"C={c.top_k}, R={c.transfer_rank}, M={c.message_size}"
    else:
        shape = "C=V (full-vocab decode)"
    out = [
        f"### {name}",
        "",
        f"batch {batch}, block {t}, {L} drafter layers, H={h}, V={c.vocab_size}, S={context_slots}, {shape}, "
        + jnp.dtype(dtype).name,
        "",
        "| piece | GFLOP | MB accessed | FLOP share |",
        "|---|---:|---:|---:|",
    ]
    full = rows[0][1][0]
    for label, (flops, nbytes) in rows:
        out.append(f"| {label} | {flops / 1e9:.4f} | {nbytes / 1e6:.2f} | {100 * flops / full:.1f}% |")
    note = f"Gathers charged as whole tables: embedding lookup in the backbone {embed_gather / 1e6:.2f} MB"
    if c.kind == "dspine":
        note += f", LM-head columns in the LWR table {head_gather / 1e6:.2f} MB"
    return [*out, "", note + ".", ""]


def main() -> None:
    common = {
        "num_key_value_heads": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "intermediate_size": 96,
        "hidden_size": 64,
    }
    tiny_target = {
        **common,
        "model_type": "qwen3",
        "vocab_size": 128,
        "num_hidden_layers": 3,
        "max_position_embeddings": 512,
    }
    tiny_drafter = {
        **common,
        "num_hidden_layers": 5,
        "vocab_size": 128,
        "num_target_layers": 3,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0, 1]},
    }
    big = {
        "num_key_value_heads": 8,
        "num_attention_heads": 32,
        "head_dim": 128,
        "intermediate_size": 12288,
        "hidden_size": 4096,
        "vocab_size": 151936,
        "rope_theta": 1e6,
    }
    qwen8b_target = {**big, "model_type": "qwen3", "num_hidden_layers": 36, "max_position_embeddings": 40960}
    qwen8b_drafter = {
        **big,
        "num_hidden_layers": 5,
        "num_target_layers": 36,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669},
        "layer_types": ["sliding_attention"] * 5,
        "use_sliding_window": True,
        "sliding_window": 8192,
    }
    spine = {"dspine_config": {"transfer_rank": 1024, "message_size": 512, "top_k": 16}}
    tiny_spine = {"dspine_config": {"transfer_rank": 32, "message_size": 16, "top_k": 16}}
    lines = ["## Tiny target (the test fixture's shapes)", ""]
    lines += measure(
        "DSpine, tiny", tiny_target, {**tiny_drafter, **tiny_spine}, batch=1, context_slots=64, dtype=jnp.float32
    )
    lines += measure("DFlash, tiny", tiny_target, tiny_drafter, batch=1, context_slots=64, dtype=jnp.float32)
    lines += ["## Qwen3-8B-shaped drafter (shapes only; window 8192 → 8191-slot ring)", ""]
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[os.environ.get("COST_DTYPE", "f32")]
    lines += measure(
        "DSpine, Qwen3-8B shapes", qwen8b_target, {**qwen8b_drafter, **spine}, batch=1, context_slots=8191, dtype=dtype
    )
    lines += measure("DFlash, Qwen3-8B shapes", qwen8b_target, qwen8b_drafter, batch=1, context_slots=8191, dtype=dtype)
    print(f"<!-- jax {jax.__version__}, backend {jax.default_backend()} -->")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
