"""Which collectives of ``generate``'s programs cross processes on a ``--tp 4 --dp 2`` mesh whose ``data`` axis
is the process boundary (2 processes × 4 devices: mesh positions 0–3 are process 0's, 4–7 process 1's).

Runs the command once in one process on 8 CPU devices with XLA's optimized HLO dumped (a fresh compilation
cache, so every program really compiles; the partitioning is the same program the two-process run executes),
then counts, per program, the collective ops and whether any of their groups spans both halves. A
collective inside a ``while`` body runs once per loop iteration (a decode round).

    python experiments/multihost/collectives.py --model smollm2-135m-instruct [--draft D] [--local-kv-writes] [--out F.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
PER_PROCESS = 4  # devices per process in the two-process run
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
_OP = re.compile(r"=\s*\S+\s+(" + "|".join(OPS) + r")(?:-start)?\(")


def groups(line: str) -> list[list[int]]:
    """The device groups of one collective (explicit ``{{…}}`` lists, the iota form ``[G,S]<=[dims]T(perm)``,
    or a permute's source→target pairs)."""
    explicit = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        g, s, dims, perm = iota.groups()
        ids = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
        return ids.reshape(int(g), int(s)).tolist()
    return []  # replica_groups={}: every device


def crosses(device_groups: list[list[int]]) -> bool:
    if not device_groups:
        return True
    return any(len({d // PER_PROCESS for d in group}) > 1 for group in device_groups)


def count(hlo: str) -> dict:
    """``{"counts": {op: {"within": n, "across": m}}, "across": {"op shape ← source op": n}}`` over every
    collective in the module (a loop body's counted once: it runs once per round)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    across: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        op = match.group(1)
        if crosses(groups(line)):
            counts[op]["across"] += 1
            shape = line.split("=", 1)[1].split(op, 1)[0].strip().split("{")[0]
            source = re.search(r'op_name="([^"]*)"', line)
            across[f"{op} {shape} <- {source.group(1) if source else '?'}"] += 1
        else:
            counts[op]["within"] += 1
    return {"counts": {op: dict(c) for op, c in counts.items()}, "across": dict(across.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft")
    ap.add_argument("--verify", default="4")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--local-kv-writes", action="store_true", help="the what-if of local_kv_writes.py")
    ap.add_argument("--out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as dump, tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
                   XLA_FLAGS=f"--xla_force_host_platform_device_count=8 --xla_dump_to={dump} --xla_dump_hlo_as_text")
        entry = [str(Path(__file__).with_name("local_kv_writes.py"))] if args.local_kv_writes else ["-m", "dspine_jax.generate"]
        cmd = [sys.executable, *entry, "--model", args.model, "--prompt", "Hello", "--json",
               "--max-new-tokens", str(args.max_new_tokens), "--tp", "4", "--dp", "2"]  # fmt: skip
        if args.draft:
            cmd += ["--draft", args.draft, "--verify", args.verify]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        report = {}
        for path in sorted(Path(dump).glob("*after_optimizations.txt")):
            name = re.sub(r"^module_\d+\.jit_", "", path.name).split(".")[0]
            if name.startswith(("prefill", "segment")):
                report[name] = count(path.read_text())
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
