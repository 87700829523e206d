"""Drafters: the ``Drafter`` pytree and the DFlash base kind (``drafter.py``), its context ring (``ring.py``),
the DSpine kind (``dspine.py``), drafter configs and the kind registry (``config.py``), checkpoint formats
(``io.py``)."""
