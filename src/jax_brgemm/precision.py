"""``precision=``: the accuracy a caller asks of the kernels' float32 matrix products, named
as JAX names it, and what the kernels compute for it on this CPU.

Every op takes ``precision`` like ``lax.dot_general`` (a ``lax.Precision``, a pair of them,
a ``lax.DotAlgorithmPreset``, or the strings JAX accepts) and, given None, follows
``jax.default_matmul_precision``. JAX's own equivalences hold (``'bfloat16'`` is
``DEFAULT``, ``'bfloat16_3x'`` and ``'tensorfloat32'`` are ``HIGH``, ``'float32'`` is
``HIGHEST``), and each request is one of four accuracies:

==================================================  ===========  ============================================  ===============
requested                                           accuracy     computed with AMX                             with vdpbf16ps
==================================================  ===========  ============================================  ===============
None, DEFAULT, HIGHEST, F32_F32_F32, F64 / X9       ``float32``  exact float32                                 exact float32
HIGH, BF16_BF16_F32_X3, TF32_TF32_F32(_X3)          ``bf16_3x``  3 bfloat16 products (convolutions: exact)     exact float32
BF16_BF16_F32_X6                                    ``bf16_6x``  exact float32 (no faster emulated)            exact float32
BF16_BF16_F32, BF16_BF16_BF16                       ``bf16``     1 bfloat16 product                            1 product
==================================================  ===========  ============================================  ===============

A precision is a floor on accuracy: exact float32 products (what stock XLA on CPU computes
for every request) meet each one, and bfloat16 inputs are exact in one product whatever the
precision. Where the CPU multiplies bfloat16 faster than float32 (AMX's tiles: 6-14x the FMA
rate; AVX-512-BF16's ``vdpbf16ps``, the default on AMD's Zen 4 and 5: 2x), every op
(``jb.brgemm``, ``jb.dense``, ``jb.conv2d``, ``jb.conv3d`` and every convolution kind,
``jb.dot_product_attention``, ``jb.lstm``), and the modules and ``accelerate()`` through
them, computes the ``bf16_*`` accuracies that ``EMULATED`` lists for its family from
bfloat16 products summed in float32, as asked: the operands split into parts by the kernel
as it copies, re-blocks or makes them (``cpp/layers/common/emulation.h``). With
``vdpbf16ps`` that is one product only (three cost 1.5x one float32 product); where bfloat16
is widened (AVX2, Intel without AMX) every request is exact float32. ``JAX_BRGEMM_EMULATE=1``
(read at import) emulates every ``bf16_*`` request on any CPU, ``=0`` none.

An operand holding an infinity (or a value beyond bfloat16's largest, whose high part
would be one) makes the op compute exact float32 instead: the infinity times another
operand's low part (zero, or of the other sign) would give NaN where float32 gives an
infinity.

A request outside the table (float16 or float8 algorithms, unequal per-operand pairs) is a
``ValueError`` naming the argument.
"""

from __future__ import annotations

import os

import jax
from jax import lax


def _switch(value: str):
    if value not in ("", "0", "1"):
        raise ValueError(f"JAX_BRGEMM_EMULATE={value!r}: set it to 1 (emulate every bf16_* precision), "
                         f"0 (compute every one as exact float32) or leave it unset (EMULATED decides)")
    return {"1": True, "0": False}.get(value)


#: JAX_BRGEMM_EMULATE: True emulates every bf16_* accuracy, False none, None follows EMULATED.
EMULATE = _switch(os.environ.get("JAX_BRGEMM_EMULATE", ""))

#: What this CPU multiplies bfloat16 in (``multiplier()``) -> accuracy -> the op families
#: (``family()``) that compute it from bfloat16 products by default: where their training
#: steps were measured faster emulated than in exact float32 (``bench/bench_precisions.py``;
#: docs/performance/xeon-amx.md and zen5.md). AMX's bf16_3x convolutions ran at 0.67x exact
#: float32 and its bf16_6x steps no faster: exact there. vdpbf16ps (AMD Zen 4 and 5 by
#: default) multiplies at twice the FMA rate: one product 1.2-1.7x, three 0.63-0.66x.
EMULATED = {
    "amx": {"bf16": ("dense", "conv", "attention", "lstm"), "bf16_3x": ("dense", "attention", "lstm")},
    "vdpbf16ps": {"bf16": ("dense", "conv", "attention", "lstm")},
    "float32": {},  # bfloat16 widened: the emulation only adds work
}


def family(op: str) -> str:
    """The op family of an op, layer or module name (``"jb.conv2d"``, ``"Conv"``,
    ``"MultiHeadDotProductAttention"``, ...): conv, attention, lstm, or dense (jb.dense,
    jb.brgemm and every other matrix product)."""
    name = op.lower()
    return next((f for f in ("conv", "attention", "lstm") if f in name), "dense")


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


def multiplier() -> str:
    """What the kernels multiply bfloat16 operands with in this process: ``"amx"`` (tiles),
    ``"vdpbf16ps"`` (AVX-512-BF16 dot products) or ``"float32"`` (widened to float32 FMAs).
    ``JAX_BRGEMM_ISA`` and ``JAX_BRGEMM_BF16`` change it."""
    from jax_brgemm import _native

    if _native.isa() == "amx":
        return "amx"
    return "vdpbf16ps" if _native.bf16_multiply() == "bfloat16" else "float32"


def computed(requested: str, op: str = "jb.dense") -> str:
    """What the kernels of ``op`` (an op, layer or module name: ``family()``) compute for a
    requested accuracy: the requested one from bfloat16 products where ``EMULATED`` lists it
    for this CPU and op family (or ``JAX_BRGEMM_EMULATE=1`` forces it), exact float32
    otherwise."""
    if requested == "float32" or EMULATE is False:
        return "float32"
    return requested if EMULATE or family(op) in EMULATED[multiplier()].get(requested, ()) else "float32"
