"""``python -m dspine_jax.generate`` with the KV-cache writes run per device (a what-if for RESULTS.md).

On a mesh whose ``data`` axis splits the rows, ``cache._write_heads_major`` writes each row's new K/V with
``dynamic_update_slice`` at a row index (or a scatter above ``ROW_LOOP_MAX_BATCH`` rows); GSPMD does not see
that a row's write stays on its own data shard and moves every row's block to the first shard and back
(two cross-shard collective-permutes per layer per round: 60 per token for SmolLM2). Here the same write runs
inside ``mesh.per_device`` (``shard_map``), each device writing its own rows: no collective at all.

    python experiments/multihost/local_kv_writes.py --model M --prompt … --tp 4 --dp 2 [--coordinator …]
"""

from __future__ import annotations

import runpy

from dspine_jax.models import cache
from dspine_jax.parallel.mesh import per_device

_write = cache._write_heads_major


def _write_per_device(cache_array, block, lengths, scatter_above):
    def write(cache_shard, block_shard, lengths_shard):
        return _write(cache_shard, block_shard, lengths_shard, scatter_above)

    return per_device(write, in_axes=[cache.KV_AXES, cache.KV_AXES, ("batch",)], out_axes=cache.KV_AXES)(
        cache_array, block, lengths
    )


if __name__ == "__main__":
    cache._write_heads_major = _write_per_device
    runpy.run_module("dspine_jax.generate", run_name="__main__")
