"""Replay memory vs full-state snapshots for a Qwen3.5-27B-like hybrid target (see replay_memory.md).

    python experiments/replay_memory.py [--block 16] [--dtype-bytes 2]

The per-token record is what ``dspine_jax.models.gdn.GdnReplay`` stores (conv inputs, k, v in the model
dtype; g in fp32; β in the model dtype); the snapshot is what a design that keeps the GDN cache
entry after every block position would store (fp32 recurrent state + fp32 conv window, as in
``cache.HybridCache``).
"""

from __future__ import annotations

import argparse

from dspine_jax.models.config import hybrid_config_from_dict

# Qwen3.5-27B-like text config (the published 27B's GDN shapes as we understand them: 64 layers,
# every 4th one full attention → 48 GDN layers; 16 key heads, 48 value heads, 128-dim heads).
QWEN3_5_27B_LIKE = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    full_attention_interval=4,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="model dtype: 2 = bf16, 4 = f32")
    args = ap.parse_args()
    cfg = hybrid_config_from_dict(QWEN3_5_27B_LIKE)
    lg = len(cfg.gdn_layers)
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, c, w = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_conv_dim, cfg.linear_conv_kernel - 1
    b = args.dtype_bytes

    state = nv * dk * dv * 4  # fp32 recurrent state, per layer
    window = c * w * 4  # fp32 conv window, per layer
    snapshot = lg * (state + window)
    per_token = {
        "conv inputs  C": c * b,
        "k  Nk*Dk": nk * dk * b,
        "v  Nv*Dv": nv * dv * b,
        "g  Nv (fp32)": nv * 4,
        "beta  Nv": nv * b,
    }
    per_pos = lg * sum(per_token.values())
    minimal = lg * (c * b + nv * 4 + nv * b)  # conv inputs + g + β only; k, v recomputed by the conv

    print(f"GDN layers {lg}, Nk {nk}, Nv {nv}, Dk {dk}, Dv {dv}, conv channels C {c}, window W {w}, "
          f"model dtype {b} bytes")
    print(f"snapshot per position: state {lg} x {state:,} B + window {lg} x {window:,} B = {snapshot:,} B "
          f"({snapshot / MiB:.1f} MiB)")
    for name, size in per_token.items():
        print(f"  per token per layer  {name:16s} {size:>8,} B")
    print(f"replay record per position: {lg} x {per_pos // lg:,} B = {per_pos:,} B ({per_pos / MiB:.2f} MiB); "
          f"{snapshot / per_pos:.0f}x smaller than a snapshot")
    print(f"minimal record (conv inputs + g + beta): {minimal:,} B ({minimal / MiB:.2f} MiB) per position")
    n = args.block
    print(f"block of {n}, per sequence: snapshots {n} x = {n * snapshot / MiB:,.0f} MiB; replay "
          f"{n * per_pos / MiB:.1f} MiB + one pre-block state {snapshot / MiB:.1f} MiB = "
          f"{(n * per_pos + snapshot) / MiB:.1f} MiB")


if __name__ == "__main__":
    main()
