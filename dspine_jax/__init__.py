"""dspine_jax: DSpine speculative decoding in pure JAX/Pallas."""

import warnings

# The package exports the function ``generate`` and also ships the CLI module ``dspine_jax.generate``;
# ``python -m dspine_jax.generate`` therefore finds the module already imported, which is harmless.
warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package.*", category=RuntimeWarning)

from dspine_jax.drafter_io import init_drafter, load_drafter, save_drafter
from dspine_jax.generate import GenerationResult, generate
from dspine_jax.speculative import SpeculativeResult, speculative_generate
from dspine_jax.target import Target, load_target
from dspine_jax.tokenizer import load_tokenizer

__all__ = [
    "GenerationResult",
    "Target",
    "generate",
    "init_drafter",
    "load_drafter",
    "load_target",
    "load_tokenizer",
    "save_drafter",
    "SpeculativeResult",
    "speculative_generate",
]
__version__ = "0.1.0"
