"""Parallelism: the device mesh and per-device kernels (``mesh.py``), placing weights and caches on it
(``sharding.py``)."""
