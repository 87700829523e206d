"""The server across processes (``serve/replica.py``) on this CPU: two processes × 4 CPU devices (gloo), one
``--tp 4 --dp 2`` mesh whose ``data`` axis crosses them; process 0 serves HTTP, process 1 follows.

Through the ``openai`` client, greedy completions at concurrency 1 and 4 equal single-process ``generate``
(the server drafts with a fresh DSpine drafter, verify 4: fewer programs to compile than auto). A killed follower fails the request in flight
with a 503 and process 0 exits non-zero within a bounded time; Ctrl-C on process 0 stops both processes
cleanly. The hang case (a follower that stops answering: the watchdog) is covered in-process below.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from unittest import mock

import pytest
from conftest import require
from test_multihost import REPO, save_char_tokenizer, worker_env

from dspine_jax.parallel.distributed import free_port
from dspine_jax.serve import replica

openai = require("openai")
cli = importlib.import_module("dspine_jax.generate")

MAX_NEW = 12
PROMPTS = ["Hello, world", "The quick brown fox jumps", "def f(x):", "1, 2, 3, 4, 5, 6, 7, 8"]
START_TIMEOUT_S = 240  # loading and starting on 2 busy cores (~20-40 s here)
REQUEST_TIMEOUT_S = 240  # first requests compile their programs (--warmup none)
EXIT_TIMEOUT_S = 60  # a failed or stopped run must be over within this
# A killed peer usually breaks the next collective at once; one that dies while a new group of devices first
# connects leaves gloo retrying the connection, and then the watchdog ends the wait after this long.
PEER_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A dense Qwen3 that splits 4 ways, with four layers (a fresh DSpine drafter taps three)."""
    from conftest import make_tiny_hf_model

    out = tmp_path_factory.mktemp("multihost_serve") / "qwen3"
    make_tiny_hf_model("qwen3", out, seed=1, eos_token_id=127, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=8, intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=False)  # fmt: skip
    save_char_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def expected(tiny_dir) -> dict[str, str]:
    """Each prompt's greedy completion from one process (``python -m dspine_jax.generate``, no drafter)."""
    texts = {}
    with mock.patch.object(cli, "enable_compilation_cache", lambda: None):  # keep this process's JAX config
        for prompt in PROMPTS:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                cli.main(["--model", str(tiny_dir), "--prompt", prompt, "--max-new-tokens", str(MAX_NEW), "--json"])
            record = json.loads(out.getvalue())
            assert record["num_tokens"] == MAX_NEW
            texts[prompt] = record["text"]
    return texts


class Pair:
    """Two server processes on one mesh; process 0 listens at ``base``."""

    def __init__(self, model_dir: Path, tmp: Path, extra: list[str]):
        self.port, coordinator = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "dspine_jax.serve", "--model", str(model_dir), "--port", str(self.port),
                   "--tp", "4", "--dp", "2", "--max-running-requests", "4", "--context-length", "96",
                   "--draft", "init:dspine", "--verify", "4", "--warmup", "none", "--coordinator", f"127.0.0.1:{coordinator}",
                   "--num-processes", "2", "--peer-timeout", str(PEER_TIMEOUT_S), *extra]  # fmt: skip
        self.logs = [tmp / f"process{rank}.log" for rank in range(2)]
        self.procs = [subprocess.Popen([*command, "--process-id", str(rank)], cwd=REPO, env=worker_env(),
                                       stdout=subprocess.DEVNULL, stderr=open(self.logs[rank], "w"))
                      for rank in range(2)]  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.kill()
                pytest.fail(f"the two processes did not start serving:\n{self.log(0)[-3000:]}\n{self.log(1)[-3000:]}")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)

    def complete(self, prompt: str, max_tokens: int = MAX_NEW) -> str:
        return self.client.completions.create(model="qwen3", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0).choices[0].text  # fmt: skip

    def generated_tokens(self) -> int:
        """The server's ``dspine_generation_tokens_total``."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=5) as response:
            text = response.read().decode()
        return int(re.search(r"^dspine_generation_tokens_total (\d+)", text, re.M).group(1))

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait(self, rank: int, timeout: float = EXIT_TIMEOUT_S) -> int:
        return self.procs[rank].wait(timeout=timeout)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    p = Pair(tiny_dir, tmp_path_factory.mktemp("pair"), [])
    yield p
    p.kill()


def test_concurrency_1_equals_one_process(pair, expected):
    for prompt in PROMPTS[:2]:
        assert pair.complete(prompt) == expected[prompt]


def test_concurrency_4_equals_one_process(pair, expected):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(pair.complete, PROMPTS))
    assert got == [expected[p] for p in PROMPTS]


def test_killed_follower_fails_requests_with_503_and_the_leader_exits(pair, expected):
    """(Runs after the tests above: it ends the pair.) The follower dies while a long request decodes."""
    result: dict = {}

    def long_request() -> None:
        try:
            result["text"] = pair.complete(PROMPTS[0], max_tokens=80)
        except openai.APIStatusError as e:
            result["status"], result["message"] = e.status_code, str(e)
        except openai.APIConnectionError as e:  # (the leader went away without answering)
            result["connection"] = repr(e.__cause__ or e)

    before = pair.generated_tokens()
    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while pair.generated_tokens() == before and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)  # (until the request decodes: its programs compiled, its first tokens out)
    pair.procs[1].kill()
    killed = time.monotonic()
    thread.join(timeout=PEER_TIMEOUT_S + EXIT_TIMEOUT_S)
    assert not thread.is_alive(), "the request in flight hung"
    own_lines = "\n".join(line for line in pair.log(0).splitlines() if line.startswith("[dspine_jax"))
    assert result.get("status") == 503, (f"{result}, {time.monotonic() - killed:.1f}s after the kill\n"
                                         f"{own_lines[-3000:]}\n{pair.log(0)[-3000:]}")  # fmt: skip
    assert "lost the other processes" in result["message"] or "no answer from the other processes" in result["message"]
    assert pair.wait(0) == replica.FAILURE_EXIT_CODE, pair.log(0)[-3000:]


def test_ctrl_c_on_process_0_stops_both(tiny_dir, tmp_path):
    p = Pair(tiny_dir, tmp_path, [])
    try:
        p.procs[0].send_signal(signal.SIGINT)
        assert p.wait(0) == 0, p.log(0)[-3000:]
        assert p.wait(1) == 0, p.log(1)[-3000:]
        assert "process 0 stopped the run" in p.log(1)
    finally:
        p.kill()


def test_watchdog_fires_only_past_its_timeout():
    fired: list[tuple[str, float]] = []
    dog = replica.Watchdog(0.4, lambda what, seconds: fired.append((what, seconds)))
    with dog.guard("quick"):
        time.sleep(0.1)
    time.sleep(0.5)
    assert fired == []
    with dog.guard("stuck"):
        deadline = time.monotonic() + 3
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    assert fired and fired[0][0] == "stuck" and fired[0][1] > 0.4


def test_the_runtime_outwaits_the_watchdog():
    """JAX aborts a process whose peer is silent past its heartbeat timeout (no 503, no clean exit), and may
    call a peer dead as early as half that timeout after its death: the server's watchdog must fire first,
    whatever ``--peer-timeout`` says."""
    for peer_timeout in (1, PEER_TIMEOUT_S, replica.DEFAULT_PEER_TIMEOUT_S, 3600):
        assert replica.heartbeat_timeout(peer_timeout) / 2 >= peer_timeout + 30


def test_exchange_is_the_message_itself_in_one_process():
    for message in (b"", b"x" * 10, bytes(range(256)) * 20):  # one header; a header and the rest
        assert replica.exchange(message) == message
