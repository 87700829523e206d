"""dspine_jax: DSpine speculative decoding in pure JAX/Pallas."""

import os
import warnings

# The Pallas kernels live in the repository's kernels/pallas/ and import as ``dspine_jax.pallas``: pyproject maps
# the folder into the installed package; from a checkout that is not installed (a device machine running the
# experiments), the subpackage is found in that folder.
_checkout_kernels = os.path.join(os.path.dirname(__path__[0]), "kernels")
if not os.path.isdir(os.path.join(__path__[0], "pallas")) and os.path.isfile(
    os.path.join(_checkout_kernels, "pallas", "dispatch.py")
):
    __path__.append(_checkout_kernels)

# The package exports the function ``generate`` and also ships the CLI module ``dspine_jax.generate``. The
# CLI module is imported first so that the name ends up bound to the function (a later ``import
# dspine_jax.generate`` finds the module loaded and leaves the attribute alone); ``python -m
# dspine_jax.generate`` therefore finds the module already imported, which is harmless.
warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package.*", category=RuntimeWarning)

from dspine_jax import generate as _generate_cli  # noqa: F401, I001  (before the function of the same name)
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.planning import GenerationResult
from dspine_jax.decoding.speculative import SpeculativeResult, speculative_generate
from dspine_jax.drafters.io import init_drafter, load_drafter, save_drafter
from dspine_jax.models.target import Target, load_target
from dspine_jax.models.tokenizer import load_tokenizer

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
