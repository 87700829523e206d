"""File helpers shared by ``models/`` (the alias cache, the GGUF converter) and ``train/`` (corpus shards,
feature stores): one file hash and one JSON writer, so checksums and written configs agree everywhere.

Deliberately dependency-free (stdlib only) and importing nothing from ``dspine_jax``: any layer may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

__all__ = ["sha256_file", "write_json"]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (a wheel or a shard is never held in memory whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """``obj`` as indented UTF-8 JSON (non-ASCII kept as is) with a final newline, the layout HF configs use."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
