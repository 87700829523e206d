"""``python -m dspine_jax.generate`` with the KV-cache writes run per device — the what-if behind RESULTS.md's
``--local-kv-writes`` rows, measured while ``cache.write_block`` still wrote through GSPMD.

``cache.write_block`` has since run the write per device itself (``mesh.per_device``), so this now runs
``dspine_jax.generate`` unchanged and the rows without ``--local-kv-writes`` describe the code before that change.

    python experiments/multihost/local_kv_writes.py --model M --prompt … --tp 4 --dp 2 [--coordinator …]
"""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("dspine_jax.generate", run_name="__main__")
