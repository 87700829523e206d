"""Target models: the family registry (``family.py``) and its built-in families (``dense.py``, ``hybrid.py``
with ``gdn.py``), the ``Target`` API every caller uses (``target.py``), caches, layers, weights, the model
hub (``hub.py``, with the GGUF converter behind its alias in ``gguf.py``) and tokenizers."""
