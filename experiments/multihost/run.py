"""2 processes × 4 CPU devices vs 1 process × 8 CPU devices, the same ``--tp 4 --dp 2`` mesh, for
``python -m dspine_jax.generate`` (tok/s as the command reports it: prefill + decode, compilation excluded),
interleaved repeats, medians; plus the cost of the host-level collectives the decode path adds across
processes (``distributed.agree``: one broadcast per adaptive segment; ``to_host``: one gather of the result).

    python experiments/multihost/run.py --model smollm2-135m-instruct --repeats 5 --out experiments/multihost/results_ar.json
    python experiments/multihost/run.py --model smollm2-135m-instruct --draft checkpoints/smollm2-135m-dspine-b8 --verify 4 --repeats 3 --out experiments/multihost/results_spec.json

``1x8-gloo`` is the one process again with the multi-process runtime started for it alone (``--num-processes
1``): its collectives then go through gloo, as they must across processes, which separates what gloo costs
from what crossing a process boundary costs. ``--local-kv-writes`` runs ``local_kv_writes.py`` instead.

Each configuration runs once untimed first (it fills the persistent compilation cache, so later runs load
their programs instead of compiling them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dspine_jax.parallel.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Write a Python function that reverses a string."


def env(devices: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def command(args: argparse.Namespace) -> list[str]:
    entry = [str(Path(__file__).with_name("local_kv_writes.py"))] if args.local_kv_writes else ["-m", "dspine_jax.generate"]
    cmd = [sys.executable, *entry, "--model", args.model, "--prompt", PROMPT, "--chat",
           "--max-new-tokens", str(args.max_new_tokens), "--json", "--tp", "4", "--dp", "2"]  # fmt: skip
    return cmd + (["--draft", args.draft, "--verify", args.verify] if args.draft else [])


def one_process(args: argparse.Namespace, gloo: bool = False) -> dict:
    """One process on 8 devices; ``gloo``: with the multi-process runtime started for one process, so its
    collectives go through gloo (as they do across processes) instead of in-process memory."""
    extra = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "1", "--process-id", "0"] if gloo else []
    done = subprocess.run(command(args) + extra, cwd=REPO, env=env(8), text=True, capture_output=True,
                          timeout=args.timeout)  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout)


def two_processes(args: argparse.Namespace, extra: list[str] | None = None, script: list[str] | None = None) -> str:
    """Process 0's stdout (process 1's must be empty)."""
    port = free_port()
    base = script or command(args)
    procs = [subprocess.Popen([*base, *(extra or []), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(rank)], cwd=REPO, env=env(4), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(err[-2000:])
    assert outs[1][0] == "", "process 1 printed on stdout"
    return outs[0][0]


def collectives_worker() -> None:
    """Run inside each of two processes: time the host-level collectives the decode path adds."""
    import jax
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    a, _ = parser.parse_known_args(sys.argv[2:])
    from jax.sharding import NamedSharding, PartitionSpec

    from dspine_jax.parallel import distributed
    from dspine_jax.parallel.mesh import make_mesh

    def per_call_ms(fn, n: int = 200) -> float:
        for _ in range(10):
            fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e3

    distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    with distributed.stdout_to_stderr():  # gloo's connection lines
        mesh = make_mesh(tp=4, dp=2)
        transcript = distributed.put(np.zeros((2, 160), np.int32), NamedSharding(mesh, PartitionSpec("data")))
        broadcast = per_call_ms(lambda: distributed.agree(0.123))
        gather = per_call_ms(lambda: distributed.to_host(transcript))
    if jax.process_index() == 0:
        print(json.dumps({"agree_scalar_ms": round(broadcast, 3), "gather_transcript_ms": round(gather, 3)}))


def main() -> None:
    if sys.argv[1:2] == ["collectives"]:
        collectives_worker()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft")
    ap.add_argument("--verify", default="auto", help="with --draft (a fixed length keeps calibration out of the runs)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--local-kv-writes", action="store_true", help="the what-if of local_kv_writes.py")
    ap.add_argument("--out")
    args = ap.parse_args()

    runs = {"1x8": lambda: one_process(args), "1x8-gloo": lambda: one_process(args, gloo=True),
            "2x4": lambda: json.loads(two_processes(args))}  # fmt: skip
    for run in runs.values():  # untimed: fill the compilation cache
        run()
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for i in range(args.repeats):  # interleaved, so a busy moment of the machine hits all alike
        for name, run in runs.items():
            rows[name].append(run())
        print(f"repeat {i + 1}: " + ", ".join(f"{name} {r[-1]['tokens_per_second']} tok/s" for name, r in rows.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    same = all(r["token_ids"] == rows["1x8"][0]["token_ids"] for rs in rows.values() for r in rs)
    median = {name: statistics.median(r["tokens_per_second"] for r in rs) for name, rs in rows.items()}
    collectives = json.loads(two_processes(args, script=[sys.executable, __file__, "collectives"]))
    result = {
        "model": args.model, "local_kv_writes": args.local_kv_writes, "draft": args.draft, "verify": args.verify if args.draft else None, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "num_tokens": rows["1x8"][0]["num_tokens"], "same_tokens": same,
        "tokens_per_second": {name: [r["tokens_per_second"] for r in rs] for name, rs in rows.items()},
        "median_tokens_per_second": median, "ratio_2x4_over_1x8": round(median["2x4"] / median["1x8"], 3),
        "ratio_1x8_gloo_over_1x8": round(median["1x8-gloo"] / median["1x8"], 3),
        "host_collectives": collectives, "cpu_count": os.cpu_count(),
    }  # fmt: skip
    if args.draft:
        result["mean_acceptance"] = {name: [r["mean_acceptance"] for r in rs] for name, rs in rows.items()}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
