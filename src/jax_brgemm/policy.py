"""Which layer calls ``accelerate()`` leaves to stock XLA although the kernels take them: a
table by ISA (``jax_brgemm.isa()``, from CPUID), fixed at import, and the measurements
behind each entry (docs/fc.md, "Dispatch policy").

It applies to stock Flax layers inside ``accelerate()`` only: ``jax_brgemm``'s own ops and
modules, used directly, and the training harness's ``impl="brgemm"`` always run the kernels.
``accelerate(policy=False)`` runs every layer the kernels take on them.
"""

from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native

# float32 matrix products of Dense-like layers (Dense, DenseGeneral, Einsum, Linear,
# LinearGeneral, attention projections). Per pass the kernels and XLA's dots are at parity
# (0.98-1.07x), but in a training step with an optax optimizer XLA runs the optimizer's
# element-wise fusions while its own dots run; after the custom calls they run alone. The
# plain MLP's step under accelerate(): AMD Zen 1 (avx2) 0.92x, AMD Zen 4 (avx512) 0.93x
# (generic step 26.0-27.7 against 24.3-25.8 ms); fp32 FC training 0.905x on a Xeon (amx).
_DENSE_F32 = ("float32 dense: XLA's own dot is as fast here and overlaps the optimizer step "
              "(dispatch policy, see docs/fc.md; accelerate(policy=False) overrides)")

#: ISA -> {(layer class, computation dtype): why it stays stock}.
TABLE = {isa: {("dense", np.dtype(jnp.float32)): _DENSE_F32}
         for isa in ("amx", "avx512", "avx2", "generic")}

_ISA = _native.isa()
_local = threading.local()


def stock_reason(layer, kind: str, dtype) -> str:
    """Why this call of a stock Flax ``layer`` of class ``kind`` computing in ``dtype`` stays
    stock under ``accelerate()``'s policy, or ``""``: it runs on the kernels."""
    if not getattr(_local, "active", False) or type(layer).__module__.startswith("jax_brgemm"):
        return ""
    return TABLE.get(_ISA, {}).get((kind, np.dtype(dtype)), "")


@contextlib.contextmanager
def applied(active: bool):
    """The policy on (or off) in this thread, as long as the context lasts."""
    before = getattr(_local, "active", False)
    _local.active = active
    try:
        yield
    finally:
        _local.active = before
