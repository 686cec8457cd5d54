"""Which layer calls ``accelerate()`` leaves to stock XLA although the kernels take them: a
table by ISA (``jax_brgemm.isa()``, from CPUID), fixed at import, and the measurements
behind each entry (docs/fc.md, "Dispatch policy").

It applies to stock Flax layers inside ``accelerate()`` only (its rules consult it):
``jax_brgemm``'s own ops and modules and the training harness's ``impl="brgemm"`` always run
the kernels.
``accelerate(policy=False)`` runs every layer the kernels take on them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native

# float32 matrix products of Dense-like layers (Dense, DenseGeneral, Einsum, Linear,
# LinearGeneral, attention projections) over few rows. Per pass the kernels and XLA's dots
# are at parity, but in a training step with an optax optimizer XLA runs the optimizer's
# element-wise fusions while its own dots run; with synchronous custom calls they ran after
# them, alone, a cost per parameter that many rows amortize: the MLP 784-1024x3-10 under
# accelerate(), AMD Zen 4 (avx512), 0.93-0.96x at 256 rows, 1.01x at 512; at 256 rows 0.92x
# on a Zen 1 (avx2), fp32 FC training 0.905x on a Xeon (amx). The FC calls are now
# asynchronous (the optimizer runs beside them); re-measured on the Zen 4 (2026-12-06, the
# same MLP, policy=False against stock, medians of 7 alternating rounds, SGD / AdamW):
# 16 rows 1.02x / 0.96x, 64 rows 1.09x / 1.01x, 128 rows 1.02x / 1.05x, 256 rows 1.06x /
# 1.00x. So avx512 keeps only calls under 64 rows stock; the other ISAs, not re-measured
# with asynchronous calls, keep the 512-row line.
_DENSE_F32 = ("float32 dense over few rows: XLA's own dot is as fast here and "
              "overlaps the optimizer step (dispatch policy, see docs/fc.md; "
              "accelerate(policy=False) overrides)")

_DENSE_ROWS = {"amx": 512, "avx512": 64, "avx2": 512, "generic": 512}

#: ISA -> {(layer class, computation dtype): (rows, why)}: such calls over fewer rows (the
#: product of the input's leading dims) stay stock.
TABLE = {isa: {("dense", np.dtype(jnp.float32)): (rows, _DENSE_F32)} for isa, rows in _DENSE_ROWS.items()}

_ISA = _native.isa()


def stock_reason(kind: str, dtype, rows: int) -> str:
    """Why a stock layer's call of class ``kind`` computing in ``dtype`` over ``rows`` rows
    stays stock under ``accelerate()``'s policy, or ``""``: it runs on the kernels."""
    below, why = TABLE.get(_ISA, {}).get((kind, np.dtype(dtype)), (0, ""))
    return why if rows < below else ""
