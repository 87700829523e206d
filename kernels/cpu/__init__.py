"""C++ kernels for XLA:CPU (XLA FFI custom calls), built at first use: ``panel_matmul.cc`` (see
``dspine_jax.models.panels``). Imports as ``dspine_jax.cpu_kernels``."""
