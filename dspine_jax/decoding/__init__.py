"""Decoding: request planning and results (``planning.py``), sampling, autoregressive decoding
(``autoregressive.py``) and the speculative round (``speculative.py``)."""
