"""Pallas kernels for the drafter's two hot spots, each with a pure-jnp reference beside it.

* ``draft_attention``  — block queries over the context ring (sliding window, ragged rows) + the block itself
  (causal or bidirectional); online softmax over KV tiles, invisible tiles skipped.
* ``transition_cache`` — fused last-write refinement + candidate scoring → the ``[B, P, C, C]`` table.
* ``dispatch``         — which path runs: ``DSPINE_KERNELS=auto|pallas|interpret|reference``,
  ``dispatch.set_mode`` / ``dispatch.force``; ``dspine_jax.drafters.drafter`` calls the kernels through it.
"""
