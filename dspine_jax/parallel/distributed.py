"""Several processes, one program: JAX's multi-controller runtime for decoding across hosts.

Every process runs the same command (``--coordinator HOST:PORT --num-processes N --process-id I``, or
``--distributed`` on Cloud TPU, where ``jax.distributed.initialize()`` reads its environment), loads the same
weights and builds the same global mesh (``mesh.make_mesh`` over ``jax.devices()``, which then lists every
process's devices). Each process keeps only its own shards; XLA's collectives (gloo on CPU, NCCL on GPU,
ICI/DCN on TPU) carry the all-reduces between them. Host-side decisions must then agree too: every value
a process derives from its own clock (timings that choose a verify length) is replaced by process 0's
(``agree``), and results sharded over processes are gathered before reading (``to_host``).

With one process every helper is the single-process path itself (no collective, no copy).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

DEFAULT_TIMEOUT_SECONDS = 60  # how long a process waits for the coordinator (and its peers) at start
DEFAULT_HEARTBEAT_SECONDS = 100  # JAX's own: a peer silent this long aborts every process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The standard ``jax.distributed.initialize`` arguments as command-line flags."""
    group = parser.add_argument_group("several processes (JAX's multi-controller runtime)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address; start the same command on every process with its --process-id")
    group.add_argument("--num-processes", type=int, help="processes in the run (with --coordinator)")
    group.add_argument("--process-id", type=int, help="this process's rank, 0 … N-1 (with --coordinator)")
    group.add_argument("--distributed", action="store_true",
                       help="start the runtime from the environment JAX reads by itself (Cloud TPU, SLURM …)")
    group.add_argument("--coordinator-timeout", type=int, default=DEFAULT_TIMEOUT_SECONDS, metavar="SECONDS",
                       help=f"give up if the coordinator and every peer are not reachable within this time "
                       f"(default: {DEFAULT_TIMEOUT_SECONDS})")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject inconsistent flags before anything is loaded (``parser.error`` exits with status 2)."""
    given = {flag: value for flag, value in (("--num-processes", args.num_processes), ("--process-id", args.process_id))
             if value is not None}  # fmt: skip
    if args.coordinator is None:
        if given:
            parser.error(f"{', '.join(given)} need --coordinator HOST:PORT (process 0's address)")
        return
    if args.distributed:
        parser.error("--distributed reads the environment; --coordinator gives the addresses: use one")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"--coordinator: expected HOST:PORT, got {args.coordinator!r}")
    if args.num_processes is None or args.process_id is None:
        parser.error("--coordinator needs --num-processes N and --process-id I")
    if args.num_processes < 1:
        parser.error(f"--num-processes: must be >= 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id: must be in [0, {args.num_processes}), got {args.process_id}")
    if args.coordinator_timeout < 1:
        parser.error(f"--coordinator-timeout: must be >= 1 second, got {args.coordinator_timeout}")


def initialize_from_args(args: argparse.Namespace, *, heartbeat_timeout: int = DEFAULT_HEARTBEAT_SECONDS) -> None:
    """Start the runtime if the flags ask for it (``check_arguments`` first); nothing otherwise."""
    if args.coordinator is not None:
        initialize(args.coordinator, args.num_processes, args.process_id, timeout=args.coordinator_timeout,
                   heartbeat_timeout=heartbeat_timeout)  # fmt: skip
    elif args.distributed:
        initialize(timeout=args.coordinator_timeout, heartbeat_timeout=heartbeat_timeout)


def initialize(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
    timeout: int = DEFAULT_TIMEOUT_SECONDS, heartbeat_timeout: int = DEFAULT_HEARTBEAT_SECONDS,
) -> None:
    """``jax.distributed.initialize`` with a bounded wait that fails in one line. JAX itself aborts the
    process (a C++ check, a page of stack) when the coordinator does not answer, so a process other than 0
    first waits up to ``timeout`` seconds for the coordinator's port to accept a connection and raises
    ``ConnectionError`` naming the address if it never does. Process 0 *is* the coordinator: it says how long
    it waits for the others and, if they do not all come within ``timeout`` seconds, exits 1 with one line
    (before JAX's own abort). ``heartbeat_timeout``: after this many seconds without a peer's heartbeat the
    runtime aborts the process (no clean exit): a caller with its own, kinder bound sets this above it. Must
    run before anything touches a device."""
    deadline = time.monotonic() + timeout
    alone: threading.Timer | None = None
    if coordinator is not None and process_id:
        host, _, port = coordinator.rpartition(":")
        wait_for_port(host, int(port), timeout)
    elif coordinator is not None and (num_processes or 1) > 1:
        print(f"[dspine_jax] coordinator at {coordinator}: waiting up to {timeout}s for {num_processes - 1} "
              f"more process(es)", file=sys.stderr, flush=True)  # fmt: skip
        # JAX aborts process 0 (a C++ check and a page of stack) when its peers do not all come: say it in one
        # line first, and leave (the main thread is inside the runtime's wait).
        alone = threading.Timer(timeout, _peers_missing, (coordinator, num_processes, timeout))
        alone.daemon = True
        alone.start()
    remaining = max(1, int(deadline - time.monotonic()))
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=remaining + (PEERS_GRACE_SECONDS if alone else 0),
                                   heartbeat_timeout_seconds=heartbeat_timeout)  # fmt: skip
    except Exception as e:  # a bad environment, an address that does not parse …
        where = coordinator or "the address in the environment"
        raise ConnectionError(f"could not start the multi-process runtime with the coordinator at {where}: "
                              f"{first_line(e, 200)}") from None  # fmt: skip
    finally:
        if alone is not None:
            alone.cancel()


def first_line(error: BaseException, width: int = 300) -> str:
    """An error's first line (the runtime's messages run to pages), or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:width]


PEERS_GRACE_SECONDS = 10  # process 0 gives up on its peers itself, this long before JAX would


def _peers_missing(coordinator: str, num_processes: int, timeout: int) -> None:
    print(f"error: the coordinator at {coordinator} waited {timeout}s, but not all {num_processes} processes joined "
          f"(start every process with --coordinator {coordinator} --num-processes {num_processes} and its own "
          f"--process-id; --coordinator-timeout waits longer)", file=sys.stderr, flush=True)  # fmt: skip
    os._exit(1)


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; ``ConnectionError`` naming it after ``timeout``
    seconds (the coordinator may start a little after its followers: refusals are retried until then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                reason = e.strerror or type(e).__name__
                raise ConnectionError(f"could not reach the coordinator at {host}:{port} within {timeout:g}s "
                                      f"({reason})") from None  # fmt: skip
            time.sleep(0.25)


def multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    """Process 0: the one that prints (and, later, serves)."""
    return jax.process_index() == 0


def put(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``value`` (a host or single-device array, the same on every process) placed by ``sharding``. Each
    process transfers only the shards its own devices hold."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree: Any) -> Any:
    """Every array of ``tree`` as host numpy, on every process. Arrays sharded over devices of other
    processes are gathered (a collective: every process must call this at the same point)."""
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(leaf, jax.Array) or leaf.is_fully_addressable or leaf.is_fully_replicated for leaf in leaves):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def agree(value: Any) -> Any:
    """Process 0's ``value`` (a pytree of host numbers or arrays) on every process: decisions a process would
    take from its own clock or disk (a measured time, a cached cost) are taken from process 0's, so every
    process runs the same programs in the same order. One process: ``value`` itself."""
    if not multiprocess():
        return value
    # (scalars come back as Python numbers, as they went in; float64 travels as float32 without jax_enable_x64)
    return jax.tree.map(lambda x: x.item() if np.ndim(x) == 0 else x, multihost_utils.broadcast_one_to_all(value))


def agree_optional(value: Any, template: Any) -> Any:
    """``agree`` for a value process 0 may or may not have (a cache entry: None when absent). ``template``:
    a value of the same structure (what every process sends when it has none, or one of another shape, so the
    broadcast's structure is the same everywhere). One process: ``value`` itself."""
    if not multiprocess():
        return value
    shaped = value is not None and jax.tree.structure(value) == jax.tree.structure(template)
    present, agreed = agree((np.bool_(shaped), value if shaped else template))
    return agreed if present else None


class DivergenceError(RuntimeError):
    """Processes that should have computed the same thing did not."""


def check_step(seconds: float, digest: int) -> float:
    """One collective per engine step across processes: every process's ``digest`` of what the step emitted
    (as each process read it) must be equal, else ``DivergenceError`` on every process alike; returns
    process 0's ``seconds`` (the step's time, which refines the verify costs, so every process plans alike).
    One process: ``seconds``."""
    if not multiprocess():
        return seconds
    mine = np.asarray([digest & 0x7FFFFFFF, min(int(seconds * 1e6), 2**31 - 1)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 2]
    if np.any(every[:, 0] != every[0, 0]):
        raise DivergenceError(f"processes emitted different tokens in one step (digests {every[:, 0].tolist()})")
    return float(every[0, 1]) / 1e6


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 goes to stderr inside: gloo (the CPU collectives) prints a line on stdout each time a
    device group first connects, which would break a command's ``--json`` output. Python's ``sys.stdout``
    goes along (it writes to descriptor 1)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def free_port() -> int:
    """An unused local TCP port (for a coordinator on this host: tests, experiments)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
