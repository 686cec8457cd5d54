"""``precision=``: the accuracy a caller asks of the kernels' float32 matrix products, named
as JAX names it, and what the kernels compute for it on this CPU.

Every op takes ``precision`` like ``lax.dot_general`` (a ``lax.Precision``, a pair of them,
a ``lax.DotAlgorithmPreset``, or the strings JAX accepts) and, given None, follows
``jax.default_matmul_precision``. JAX's own equivalences hold (``'bfloat16'`` is
``DEFAULT``, ``'bfloat16_3x'`` and ``'tensorfloat32'`` are ``HIGH``, ``'float32'`` is
``HIGHEST``), and each request is one of four accuracies:

==================================================  ===========  ==================================
requested                                           accuracy     computed (``JAX_BRGEMM_EMULATE=1``)
==================================================  ===========  ==================================
None, DEFAULT, HIGHEST, F32_F32_F32, F64 / X9       ``float32``  exact float32
HIGH, BF16_BF16_F32_X3, TF32_TF32_F32(_X3)          ``bf16_3x``  exact float32 (3 bf16 products)
BF16_BF16_F32_X6                                    ``bf16_6x``  exact float32 (6 bf16 products)
BF16_BF16_F32, BF16_BF16_BF16                       ``bf16``     exact float32 (1 bf16 product)
==================================================  ===========  ==================================

A precision is a floor on accuracy: exact float32 products (what stock XLA on CPU computes
for every request) meet each one, and bfloat16 inputs are exact in one product whatever the
precision. With ``JAX_BRGEMM_EMULATE=1`` (read at import), every op (``jb.brgemm``,
``jb.dense``, ``jb.conv2d``, ``jb.conv3d`` and every convolution kind,
``jb.dot_product_attention``, ``jb.lstm``), and the modules and ``accelerate()`` through them,
computes the ``bf16_*`` accuracies as asked instead, from bfloat16 products summed in float32:
the operands split into parts by the kernel as it copies, re-blocks or makes them
(``cpp/layers/common/emulation.h``). An operand holding an
infinity (or a value beyond bfloat16's largest, whose high part would be one) makes the op
compute exact float32 instead: the infinity times another operand's low part (zero, or of
the other sign) would give NaN where float32 gives an infinity. That can only pay with AMX, whose bfloat16 products run 6-14x the
float32 FMA rate (AVX-512-BF16's ``vdpbf16ps`` runs them at twice the rate, so three cost
1.5x one float32 product; AVX2 has no bfloat16 products); it stays opt-in until measured
there.

A request outside the table (float16 or float8 algorithms, unequal per-operand pairs) is a
``ValueError`` naming the argument.
"""

from __future__ import annotations

import os

import jax
from jax import lax

#: Compute the bf16_* accuracies from bfloat16 products (ops/emulation.py).
EMULATE = os.environ.get("JAX_BRGEMM_EMULATE", "0") == "1"

_P, _A = lax.Precision, lax.DotAlgorithmPreset

#: Every precision the ops take -> the accuracy it asks for.
ACCURACY = {
    None: "float32", _P.DEFAULT: "float32", _P.HIGHEST: "float32", _P.HIGH: "bf16_3x",
    _A.DEFAULT: "float32", _A.F32_F32_F32: "float32", _A.F64_F64_F64: "float32",
    _A.BF16_BF16_F32_X9: "float32", _A.BF16_BF16_F32_X6: "bf16_6x",
    _A.BF16_BF16_F32_X3: "bf16_3x", _A.TF32_TF32_F32: "bf16_3x", _A.TF32_TF32_F32_X3: "bf16_3x",
    _A.BF16_BF16_F32: "bf16", _A.BF16_BF16_BF16: "bf16",
}


def _one(value, op: str, name: str):
    """A lax.Precision or DotAlgorithmPreset from one value of JAX's forms, or a ValueError."""
    if isinstance(value, str):
        for parse in (_P, lambda v: _A[v]):
            try:
                return parse(value)
            except (ValueError, KeyError):
                pass
    if value is None or isinstance(value, (_P, _A)):
        return value
    raise ValueError(f"{op}: {name} must be None, a jax.lax.Precision, a pair of them, a "
                     f"jax.lax.DotAlgorithmPreset or one of their names, got {value!r}")


def accuracy(precision, op: str, name: str = "precision") -> str:
    """The accuracy ``precision`` asks for (``ACCURACY``'s values); None follows
    ``jax.default_matmul_precision``. Raises ValueError naming ``name`` for anything else."""
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2:
            raise ValueError(f"{op}: {name} as a sequence must be a pair (lhs, rhs), got {precision!r}")
        lhs, rhs = (_one(p, op, name) for p in precision)
        if lhs != rhs:
            raise ValueError(f"{op}: {name} {precision!r} asks different precisions of the two "
                             f"operands; the kernels take one for both")
        key = lhs
    else:
        key = _one(precision, op, name)
    if key is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is not None:
            name, key = "jax.default_matmul_precision", _one(precision, op, name)
    if key not in ACCURACY:
        raise ValueError(f"{op}: {name} {precision!r} asks for an algorithm the kernels do not "
                         f"compute; they take those of jax_brgemm.precision.ACCURACY")
    return ACCURACY[key]


#: The harness's --precision names -> the jax.default_matmul_precision its steps trace under.
HARNESS = {"float32": None, "bf16_3x": "BF16_BF16_F32_X3", "bf16_6x": "BF16_BF16_F32_X6",
           "bf16": "BF16_BF16_F32"}


#: accuracy -> the bfloat16 products each float32 product is computed from (0: exact).
PRODUCTS = {"float32": 0, "bf16": 1, "bf16_3x": 3, "bf16_6x": 6}


def computed(requested: str) -> str:
    """What the kernels compute for a requested accuracy: the requested one from bfloat16
    products with ``JAX_BRGEMM_EMULATE=1``, exact float32 otherwise."""
    return requested if EMULATE and requested != "float32" else "float32"
