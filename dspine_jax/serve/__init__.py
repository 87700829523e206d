"""OpenAI-compatible serving: ``python -m dspine_jax.serve`` (see ``__main__``), the continuous-batching
engine (``engine``), the HTTP layer (``server``), Qwen3 output parsers (``parsers``) and metrics."""
