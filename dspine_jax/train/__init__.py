"""Drafter training in JAX (optax, orbax): data regeneration, losses, training forward, loop, CLI.

``python -m dspine_jax.train.data`` builds the regenerated dataset; ``python -m dspine_jax.train`` trains.
"""
