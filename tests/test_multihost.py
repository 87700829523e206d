"""Decoding across processes: JAX's multi-controller runtime on this CPU (gloo collectives).

Two processes × 4 CPU devices each run ``python -m dspine_jax.generate … --tp 4 --dp 2 --coordinator …``: one
global 2 × 4 mesh whose ``data`` axis crosses the processes (the one-prompt request is repeated to fill it).
Process 0 must print the same greedy tokens as one process alone, process 1 nothing on stdout; a coordinator
nobody listens at must fail within a bounded time in one line naming its address.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_tiny_hf_model
from test_hybrid import make_tiny_hybrid

from dspine_jax.parallel.distributed import free_port

cli = importlib.import_module("dspine_jax.generate")  # the module (the package attribute is the function)

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Hello, world"
MAX_NEW = 12
HARD_TIMEOUT_S = 240  # a hang fails the test instead of stalling the suite (a run takes ~30-60 s on 2 cores)


def save_char_tokenizer(out_dir: Path) -> None:
    """A real (saved) tokenizer for a tiny model: one id per printable ASCII character, ids 3…97."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {chr(c): c - 29 for c in range(32, 127)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(out_dir)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A dense Qwen3 whose 8 query / 4 KV heads and MLP split 4 ways; its EOS (127) never comes up in
    12 greedy tokens of this prompt, so every run decodes the whole budget."""
    out = tmp_path_factory.mktemp("multihost") / "qwen3"
    make_tiny_hf_model("qwen3", out, seed=1, eos_token_id=127, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=8, intermediate_size=128, tie_word_embeddings=False)  # fmt: skip
    save_char_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    """A Qwen3.5 hybrid (Gated DeltaNet and full attention layers, alternating) whose heads split 4 ways; four
    layers, so that a fresh drafter finds the layers it taps."""
    out = tmp_path_factory.mktemp("multihost") / "hybrid"
    make_tiny_hybrid("qwen3_5_text", out, eos_token_id=127, num_hidden_layers=4,
                     layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=8, num_key_value_heads=8,
                     head_dim=8, intermediate_size=128, linear_num_key_heads=4, linear_num_value_heads=8,
                     linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
    save_char_tokenizer(out)
    return out


def one_process(model_dir: Path, extra: list[str], capsys, monkeypatch) -> dict:
    """The command's ``--json`` record from this (single) process."""
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)  # keep this process's JAX config
    capsys.readouterr()
    cli.main(["--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW), "--json", *extra])
    return json.loads(capsys.readouterr().out)


def worker_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def two_processes(model_dir: Path, extra: list[str]) -> list[tuple[int, str, str]]:
    """``(exit code, stdout, stderr)`` of each of two processes running the command on one 2 × 4 mesh."""
    port = free_port()
    command = [sys.executable, "-m", "dspine_jax.generate", "--model", str(model_dir), "--prompt", PROMPT,
               "--max-new-tokens", str(MAX_NEW), "--json", "--tp", "4", "--dp", "2",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", *extra]  # fmt: skip
    workers = [subprocess.Popen([*command, "--process-id", str(rank)], cwd=REPO, env=worker_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]  # fmt: skip
    deadline = time.monotonic() + HARD_TIMEOUT_S
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((worker.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"two processes did not finish within {HARD_TIMEOUT_S}s (a hang)")
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return outputs


def check_two_equal_one(model_dir: Path, extra: list[str], capsys, monkeypatch) -> dict:
    expected = one_process(model_dir, extra, capsys, monkeypatch)
    (code0, out0, err0), (code1, out1, err1) = two_processes(model_dir, extra)
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    assert out1 == "", "only process 0 prints"
    got = json.loads(out0)  # the whole of stdout is one JSON object (the collectives' chatter went to stderr)
    assert got["token_ids"] == expected["token_ids"]
    assert got["num_tokens"] == MAX_NEW and got["finish_reason"] == "length"
    return got


def test_two_processes_generate_like_one(tiny_dir, capsys, monkeypatch):
    check_two_equal_one(tiny_dir, [], capsys, monkeypatch)


def test_two_processes_decode_speculatively_like_one(tiny_dir, capsys, monkeypatch):
    """A fresh DSpine drafter at a fixed verify length (``--verify auto`` needs every length compiled and
    calibrated: minutes on 2 cores; its timings are process 0's on every process, ``distributed.agree``)."""
    got = check_two_equal_one(tiny_dir, ["--draft", "init:dspine", "--verify", "4"], capsys, monkeypatch)
    assert set(got["verify_lengths"]) == {4}


def test_two_processes_decode_a_hybrid_speculatively_like_one(hybrid_dir, capsys, monkeypatch):
    check_two_equal_one(hybrid_dir, ["--draft", "init:dspine", "--verify", "4"], capsys, monkeypatch)


def alone(model_dir: Path, process_id: int, timeout: int) -> tuple[subprocess.CompletedProcess, int, float]:
    """Process ``process_id`` of two, started alone (its peer never comes) → (the run, the coordinator's port,
    seconds it took)."""
    port = free_port()  # (for process 1: nobody listens there)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dspine_jax.generate", "--model", str(model_dir), "--prompt", PROMPT,
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
         "--coordinator-timeout", str(timeout)],
        cwd=REPO, env=worker_env(), text=True, capture_output=True, timeout=HARD_TIMEOUT_S,
    )  # fmt: skip
    return done, port, time.monotonic() - start


def test_unreachable_coordinator_fails_in_one_line(tiny_dir):
    done, port, seconds = alone(tiny_dir, 1, 2)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "coordinator" in lines[0], done.stderr
    assert seconds < 60


def test_process_0_without_its_peers_fails_in_one_line(tiny_dir):
    done, port, seconds = alone(tiny_dir, 0, 3)
    assert done.returncode == 1 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"127.0.0.1:{port}" in last and "not all 2 processes joined" in last
    assert "Check failed" not in done.stderr and seconds < 60


@pytest.mark.parametrize("flags,message", [
    (["--process-id", "1"], "need --coordinator"),
    (["--num-processes", "2"], "need --coordinator"),
    (["--coordinator", "127.0.0.1:1234"], "needs --num-processes N and --process-id I"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "expected HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "must be in [0, 2)"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "--distributed"], "use one"),
    (["--tp", "0"], "--tp and --dp must be >= 1"),
])  # fmt: skip
def test_bad_distributed_flags_are_refused_before_loading(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", "/nonexistent", "--prompt", "x", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
