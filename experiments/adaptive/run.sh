#!/usr/bin/env bash
# Adaptive verification (--verify auto) against our AR decode and fixed verify lengths, side by side on the
# held-out prompts of every domain (SmolLM2-135M-Instruct f32, batch 1, greedy). Writes report.{json,md,png}
# here. The verify cost model is measured on the first auto run per drafter and cached in
# ~/.cache/dspine_jax/verify_costs.json (delete it to measure again, e.g. on a quieter machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m dspine_jax.bench --report \
  --systems ours,ours+dspine@auto,ours+dspine@2,ours+dspine@4,ours+dspine@8,ours+dflash@auto,ours+init:dspine@auto \
  --prompts-per-domain "${PROMPTS_PER_DOMAIN:-2}" --max-new-tokens "${MAX_NEW_TOKENS:-64}" --repeats "${REPEATS:-2}" \
  --data experiments/data/smollm2-v2 --out experiments/adaptive/report.json "$@"
