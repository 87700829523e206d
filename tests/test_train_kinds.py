"""Training the DSpark and EAGLE-3 kinds (``python -m dspine_jax.train --kind dspark|eagle3``).

* The training forward computes the served model: fed the tokens the inference path drafted, its logits are
  DSpark's walk's (Markov bias given the walked token, confidence head) and EAGLE-3's draft steps'.
* A short CLI run, cut and resumed, lowers the loss on its data (fixed seed, with margin); its export
  loads through ``load_draft`` and speculative decoding with it equals ``generate`` (greedy); the model card
  names the kind's layout and reproduce options.
* Options of other kinds are refused before any work.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import dspark
from dspine_jax.drafters import eagle3 as E
from dspine_jax.drafters.io import init_drafter, load_draft
from dspine_jax.drafters.ring import append_context, init_draft_cache
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target
from dspine_jax.train.__main__ import build_drafter, main
from dspine_jax.train.card import write_card
from dspine_jax.train.data import target_features
from dspine_jax.train.loop import join_params, predict, split_params

BLOCK = 4
PROMPT, RESPONSE = 6, 18  # the tiny dataset's rows: a random prompt, the target's greedy continuation


@pytest.fixture(scope="module")
def target(tiny_models):
    """The tiny Llama target on XLA's products, as training loads it."""
    return load_target(tiny_models["llama"][0], products="xla")


@pytest.fixture(scope="module")
def rows(target):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.config.vocab_size, PROMPT).tolist() for _ in range(8)]
    res = generate(target, prompts, max_new_tokens=RESPONSE, temperature=0.0, stop_ids=[])
    return [{"key": str(i), "domain": "code", "prompt_ids": p, "response_ids": r, "finish": "length"}
            for i, (p, r) in enumerate(zip(prompts, res.token_ids))]  # fmt: skip


def _perturbed(model, seed: int = 1, scale: float = 0.1):
    """Random offsets on every trained weight, so every head and gate acts."""
    trainable, frozen = split_params(model)
    leaves, tree = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return model.replace(params=join_params(jax.tree.unflatten(tree, leaves), frozen))


def _batch(target, taps, tokens: np.ndarray) -> dict:
    feats = target_features(target, tokens, taps)
    return {"tokens": jnp.asarray(tokens), "loss_mask": jnp.ones(tokens.shape, bool),
            "tapped": jnp.moveaxis(jnp.asarray(feats[:, :, :-1]), 2, 0), "teacher_hidden": jnp.asarray(feats[:, :, -1])}  # fmt: skip


_predict = jax.jit(predict, static_argnums=2)
ANCHORS = np.array([5, 11])  # one chain per row
S = 20


# ----------------------------------------------------------------------------------------------
# The training forward is the served model


# (rnn without sample_from_anchor: block position 0 steps the state on the anchor and proposes nothing)
@pytest.mark.parametrize("head,from_anchor", [("vanilla", True), ("gated", True), ("rnn", False)])
def test_dspark_training_logits_are_the_walks(target, head, from_anchor):
    drafter = _perturbed(init_drafter(target, "dspark", num_layers=2, intermediate_size=48, block_size=BLOCK, seed=0,
                                      markov_rank=8, markov_head_type=head, sample_from_anchor=from_anchor))  # fmt: skip
    taps, p = drafter.config.target_layer_ids, BLOCK if from_anchor else BLOCK - 1  # (anchored: every position)
    tokens = np.random.default_rng(0).integers(3, target.config.vocab_size, (2, S)).astype(np.int32)
    batch = _batch(target, taps, tokens)
    cache = append_context(drafter, init_draft_cache(drafter, 2, S + BLOCK), batch["tapped"], jnp.asarray(ANCHORS))
    anchor = jnp.asarray(tokens[[0, 1], ANCHORS])
    walk = jax.jit(dspark.walk)(drafter, target, cache, anchor, jax.random.split(jax.random.key(0), 2), Sampling.rows(2))
    # The walk's own proposals after each anchor: the teacher-forced "previous tokens" are then the walked ones.
    for row, a in enumerate(ANCHORS):  # (an anchored walk's last proposal, past the block, is nobody's previous)
        tokens[row, a + 1 : a + BLOCK] = np.asarray(walk.tokens[row, : BLOCK - 1])
    trainable, frozen = split_params(drafter)
    pred = _predict(trainable, frozen, drafter.config, target.params.embed, target.params.lm_head,
                    _batch(target, taps, tokens), jnp.asarray(ANCHORS[:, None]), jnp.ones((2, 1), bool))  # fmt: skip
    assert pred.logits.shape == (2, 1, p, target.config.vocab_size) and walk.logits.shape[1] == p
    np.testing.assert_allclose(np.asarray(pred.logits[:, 0, :p]), np.asarray(walk.logits), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(pred.aux[:, 0, :p])), np.asarray(walk.confidence), atol=1e-5)


def _draft_and_force(target, proposer, taps, tokens: np.ndarray, steps: int):
    """Prefill a sequential head up to each row's anchor, draft ``steps`` steps (their logits are returned) and
    write the drafted tokens into ``tokens`` after each anchor (teacher forcing the chain the head walked)."""
    batch = _batch(target, taps, tokens)
    state = proposer.init(target, 2, S + BLOCK)
    state = jax.jit(lambda p, s, h, t, n, x: p.prefill(target, s, h, t, n, x))(
        proposer, state, batch["teacher_hidden"], batch["tapped"], jnp.asarray(ANCHORS), batch["tokens"])
    anchor = jnp.asarray(tokens[[0, 1], ANCHORS])
    out, logits = jax.jit(E.draft_steps, static_argnames="num")(
        proposer, target, state, anchor, jax.random.split(jax.random.key(0), 2), Sampling.rows(2), num=steps)
    for row, a in enumerate(ANCHORS):
        tokens[row, a + 1 : a + steps] = np.asarray(out.tokens[row, :-1])
    return logits


def test_eagle3_training_logits_are_the_draft_steps(target):
    """Two layers, a draft vocabulary: step s of the chain from an anchor reads the token step s − 1 drafted."""
    v = target.config.vocab_size
    proposer = _perturbed(E.init_eagle3(target, num_layers=2, block_size=BLOCK, draft_ids=np.arange(0, v, 2),
                                        layer_type="llama", norm_before_residual=True, norm_before_fc=True,
                                        norm_output=True), scale=0.05)  # fmt: skip
    steps = BLOCK - 1
    tokens = np.random.default_rng(1).integers(3, v, (2, S)).astype(np.int32)
    logits = _draft_and_force(target, proposer, proposer.taps, tokens, steps)
    trainable, frozen = split_params(proposer)
    pred = _predict(trainable, frozen, proposer.config, target.params.embed, target.params.lm_head,
                    _batch(target, proposer.taps, tokens), jnp.asarray(ANCHORS[:, None]), jnp.ones((2, 1), bool))  # fmt: skip
    assert pred.logits.shape == (2, 1, steps, v // 2)
    np.testing.assert_allclose(np.asarray(pred.logits[:, 0]), np.asarray(logits), atol=2e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# The CLI: train, cut, resume, export, load_draft, greedy-exact decoding, the card


def _write_data(rows, path):
    (path / "gen").mkdir(parents=True)
    (path / "gen" / "train_0000.json").write_text(json.dumps(rows))
    held = {"code": [{"key": "held-0", "prompt_ids": [7, 8, 9, 10]}]}
    (path / "prompts.json").write_text(json.dumps({"train": {}, "heldout": held}))


KIND_ARGS = {
    "dspark": ["--markov-head-type", "rnn", "--markov-rank", "8", "--block-size", str(BLOCK), "--anchors", "4",
               "--intermediate-size", "48", "--layers", "1"],
    "eagle3": ["--ttt-steps", str(BLOCK - 1), "--draft-vocab", "96", "--layers", "1"],
}  # fmt: skip


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_cli_trains_resumes_exports_and_decodes_exactly(tiny_models, target, rows, tmp_path, kind):
    """Every step's batch is all 8 rows (in a new order), so the logged losses are the loss of the same data:
    step 1's is the fresh drafter's (the run is cut there and resumed), step 30's the trained one's."""
    model_dir = str(tiny_models["llama"][0])
    data, out = tmp_path / "data", tmp_path / "run"
    _write_data(rows, data)
    common = ["--target", model_dir, "--kind", kind, "--data", str(data), "--out", str(out), "--steps", "30",
              "--batch-size", str(len(rows)), "--lr", "3e-3", "--max-len", str(PROMPT + RESPONSE),
              "--checkpoint-every", "10", "--no-progress", *KIND_ARGS[kind]]  # fmt: skip
    main(common + ["--stop-at", "1"])
    assert not (out / "export").exists()
    main(common + ["--resume"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 10, 20, 30]
    assert metrics[-1]["loss"] < 0.6 * metrics[0]["loss"] and metrics[-1]["acc"] > metrics[0]["acc"] + 0.2, metrics
    # The export loads through load_draft as the kind it trained, every trained tensor in place.
    trained = load_draft(str(out / "export"), target)
    fresh = build_drafter(target, json.loads((out / "run.json").read_text()))
    assert type(trained) is type(fresh) and trained.config.kind == kind
    shapes = [jax.tree.map(jnp.shape, split_params(m)[0]) for m in (trained, fresh)]
    assert shapes[0] == shapes[1]
    # Served: greedy speculative decoding with the export is the target's own output, drafting whole blocks.
    prompts = [r["prompt_ids"] for r in rows[:2]]
    spec = speculative_generate(target, trained, prompts, max_new_tokens=10, stop_ids=[], verify=BLOCK)
    assert spec.token_ids == [r["response_ids"][:10] for r in rows[:2]]  # (the rows are generate's, greedy)
    assert {t for row in spec.verify_lengths for t in row} == {BLOCK}
    write_card(out, tmp_path / "card", data=data)
    card = (tmp_path / "card" / "README.md").read_text()
    assert "vLLM speculators" in card and ("--markov-head-type rnn --markov-rank 8" in card if kind == "dspark"
                                           else f"--ttt-steps {BLOCK - 1}" in card and "--mask-token-id" not in card)  # fmt: skip


@pytest.mark.parametrize("kind,option", [
    ("eagle3", ["--markov-rank", "8"]), ("eagle3", ["--mask-token-id", "3"]), ("eagle3", ["--block-size", "4"]),
    ("dspark", ["--transfer-rank", "8"]), ("dspark", ["--ttt-steps", "3"]), ("dflash", ["--markov-head-type", "rnn"]),
])  # fmt: skip
def test_options_of_other_kinds_are_refused(tmp_path, kind, option):
    with pytest.raises(SystemExit, match=f"{option[0]} does not apply to --kind {kind}"):
        main(["--target", "unused", "--kind", kind, "--data", str(tmp_path), "--out", str(tmp_path / "run"), *option])


# ----------------------------------------------------------------------------------------------
# MTP (``--kind mtp``): the training forward is MTPProposer's drafting; the CLI trains, resumes, exports


@pytest.mark.parametrize("layer_type", ["qwen3", "qwen3_5_text"])  # a dense layer; the hybrids' gated one
def test_mtp_training_logits_are_the_draft_steps(target, layer_type):
    """From the target's final hidden state: step s of the chain from an anchor reads the token step s − 1
    drafted and that step's output hidden, attending to the committed entries and the round's own steps."""
    from dspine_jax.drafters import mtp as M

    proposer = _perturbed(M.init_mtp(target, block_size=BLOCK, layer_type=layer_type, dtype="float32"), scale=0.05)
    steps, v = BLOCK - 1, target.config.vocab_size
    tokens = np.random.default_rng(2).integers(3, v, (2, S)).astype(np.int32)
    logits = _draft_and_force(target, proposer, (), tokens, steps)
    trainable, frozen = split_params(proposer)
    assert frozen == {}  # embedding and LM head are the target's, passed to the step
    pred = _predict(trainable, frozen, proposer.config, target.params.embed, target.params.lm_head,
                    _batch(target, (), tokens), jnp.asarray(ANCHORS[:, None]), jnp.ones((2, 1), bool))  # fmt: skip
    assert pred.logits.shape == (2, 1, steps, v)
    np.testing.assert_allclose(np.asarray(pred.logits[:, 0]), np.asarray(logits), atol=2e-4, rtol=1e-4)


def test_cli_trains_mtp_resumes_exports_and_decodes_exactly(tiny_models, target, rows, tmp_path):
    """A fresh head on a dense target (no MTP weights of its own), speculators' step weights: the loss of the
    same data falls from step 1's (the run is cut there and resumed) to step 30's; the export is a speculators
    mtp checkpoint ``load_draft`` serves, greedy-exactly."""
    from dspine_jax.drafters import mtp as M

    model_dir = str(tiny_models["llama"][0])
    data, out = tmp_path / "data", tmp_path / "run"
    _write_data(rows, data)
    common = ["--target", model_dir, "--kind", "mtp", "--data", str(data), "--out", str(out), "--steps", "30",
              "--batch-size", str(len(rows)), "--lr", "3e-3", "--max-len", str(PROMPT + RESPONSE),
              "--checkpoint-every", "10", "--no-progress", "--ttt-steps", str(BLOCK - 1)]  # fmt: skip
    main(common + ["--stop-at", "1"])
    assert not (out / "export").exists()
    main(common + ["--resume"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 10, 20, 30]
    first, last = metrics[0], metrics[-1]
    assert last["loss"] < 0.6 * first["loss"] and last["acc"] > first["acc"] + 0.2, metrics
    assert all(last[f"ce_{s}"] < first[f"ce_{s}"] for s in range(BLOCK - 1)), metrics
    # The export is speculators' mtp layout and loads through load_draft as an MTP head, every tensor in place.
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "mtp"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    trained = load_draft(str(out / "export"), target)
    fresh = build_drafter(target, json.loads((out / "run.json").read_text()))
    assert isinstance(trained, M.MTPProposer) and isinstance(fresh, M.MTPProposer) and trained.block_limit == BLOCK
    shapes = [jax.tree.map(jnp.shape, split_params(m)[0]) for m in (trained, fresh)]
    assert shapes[0] == shapes[1]
    # Served: greedy speculative decoding with the export is the target's own output, drafting whole blocks.
    prompts = [r["prompt_ids"] for r in rows[:2]]
    spec = speculative_generate(target, trained, prompts, max_new_tokens=10, stop_ids=[], verify=BLOCK)
    assert spec.token_ids == [r["response_ids"][:10] for r in rows[:2]]
    assert {t for row in spec.verify_lengths for t in row} == {BLOCK}
    write_card(out, tmp_path / "card", data=data)
    card = (tmp_path / "card" / "README.md").read_text()
    assert "vLLM speculators MTP" in card and f"--ttt-steps {BLOCK - 1}" in card
    assert "--layers" not in card and "--mask-token-id" not in card and "--intermediate-size" not in card
