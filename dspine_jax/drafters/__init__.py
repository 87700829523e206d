"""Drafters: the ``Drafter`` pytree, its context ring and the DFlash base kind (``drafter.py``), the DSpine
kind (``dspine.py``), drafter configs and the kind registry (``config.py``), checkpoint formats (``io.py``)."""
