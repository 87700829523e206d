"""Held-out prompts kept outside the repository: drawn at evaluation time, never committed, never
trained on, never used to choose a drafter — a check that τ generalises across each domain rather
than to the repository's own held-out split.

* code, math — fresh ``reasoning-gym`` instances (seed ``OUTSIDE_SEED``, which the corpus never
  uses) of the corpus' code and math generators, phrased as the corpus phrases them;
* chat — ``chitchat-dataset`` conversations after the last one the corpus plan draws from;
* prose — Gutenberg passages (the corpus' texts) that overlap no planned or held-out passage.

Same chat template and prompt-length limit as the corpus.
"""

from __future__ import annotations

import random
from pathlib import Path

from dspine_jax.train.data import load_heldout, read_plan
from dspine_jax.train.prompts import (
    CODE_TASKS,
    DOMAINS,
    MATH_TASKS,
    PROSE_INSTRUCTIONS,
    encode_messages,
    gutenberg_words,
    reasoning_gym_questions,
)

OUTSIDE_SEED = 777_001


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def outside_prompts(tokenizer, corpus_dir: Path, cache: Path, per_domain: int, max_prompt_tokens: int = 256) -> dict[str, list[dict]]:
    plan = read_plan(corpus_dir)
    planned = {r["key"] for r in plan}
    rng = random.Random(OUTSIDE_SEED)
    code_tasks = rng.sample(CODE_TASKS, len(CODE_TASKS))
    math_tasks = rng.sample(MATH_TASKS, len(MATH_TASKS))
    pools: dict[str, list[tuple[str, list[dict]]]] = {d: [] for d in DOMAINS}
    for task in code_tasks[: 2 * per_domain]:  # spares: a prompt over the length limit is dropped
        q = reasoning_gym_questions(task, 1, OUTSIDE_SEED)[0]
        text = f"Write a Python function that solves the following task, then explain it briefly.\n\n{q}"
        pools["code"].append((f"rg-code/{task}/outside", _user(text)))
    for task in math_tasks[: 2 * per_domain]:
        q = reasoning_gym_questions(task, 1, OUTSIDE_SEED)[0]
        pools["math"].append((f"rg-math/{task}/outside", _user(q + "\nExplain your reasoning.")))

    import chitchat_dataset as ccc

    used = max(int(r["source"].split("/")[1]) for r in plan if r["source"].startswith("chitchat/"))
    for i, conv in enumerate(ccc.ConversationDataset()):
        turns = [t.strip() for t in conv if t.strip()]
        if i <= used + 100 or len(turns) < 3 or sum(map(len, turns[:3])) > 900:
            continue
        roles = ["user", "assistant", "user"]
        pools["chat"].append((f"chitchat/{i}/outside", [{"role": r, "content": t} for r, t in zip(roles, turns[:3])]))
        if len(pools["chat"]) >= 4 * per_domain:
            break

    spans: dict[str, list[tuple[int, int]]] = {}
    for r in plan:
        if r["source"].startswith("gutenberg/"):
            _, stem, span = r["source"].split("/")
            start, length = map(int, span.split("+"))
            spans.setdefault(stem, []).append((start, start + length))
    for records in load_heldout(corpus_dir).values():
        for r in records:
            if r["source"].startswith("gutenberg/"):
                _, stem, start = r["source"].split("/")
                spans.setdefault(stem, []).append((int(start), int(start) + 60))
    texts = gutenberg_words(cache)  # the corpus' own word offsets, so the span checks below compare like with like
    stems = sorted(s for s, w in texts.items() if len(w) >= 2000)
    while len(pools["prose"]) < 4 * per_domain:
        stem = rng.choice(stems)
        words, length = texts[stem], 90
        start = rng.randrange(200, len(words) - length - 10)
        # 60 words of margin around every passage the corpus (or its held-out split) uses
        if any(start < b + 60 and a - 60 < start + length for a, b in spans.get(stem, [])):
            continue
        text = rng.choice(PROSE_INSTRUCTIONS) + "\n\n" + " ".join(words[start : start + length])
        pools["prose"].append((f"gutenberg/{stem}/{start}+{length}/outside", _user(text)))

    out: dict[str, list[dict]] = {}
    for domain, items in pools.items():
        rows = []
        for source, messages in items:
            ids = encode_messages(tokenizer, messages)
            if len(ids) <= max_prompt_tokens and source not in planned:
                rows.append({"source": source, "prompt_ids": ids})
        out[domain] = rows[:per_domain]
    return out
