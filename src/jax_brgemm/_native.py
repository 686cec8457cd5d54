"""Loads the native extension once: registers its XLA FFI targets with JAX, decides the
dispatch (so a bad ``JAX_BRGEMM_ISA`` or ``JAX_BRGEMM_BF16`` fails here, at import, not
inside a compiled program) and reads the table of fused activations."""

from __future__ import annotations

import os

import jax


def _bad_isa(error: Exception) -> ValueError:
    names = ", ".join(_ISA_NAMES)
    return ValueError(
        f"JAX_BRGEMM_ISA={os.environ.get('JAX_BRGEMM_ISA')!r} is not a kernel ISA: set it to one "
        f"of {names} (it can only lower the ISA the CPU has) or unset it ({error})")


_ISA_NAMES = ("amx", "avx512", "avx2", "generic")
try:
    from jax_brgemm import _jax_brgemm
except ValueError as e:  # should the extension read the variable while it loads
    if "JAX_BRGEMM_ISA" in str(e):
        raise _bad_isa(e) from None
    raise

_ISA_NAMES = tuple(_jax_brgemm.isa_names())
# Decides the dispatch (ISA, bf16 multiply path) once, now: a bad JAX_BRGEMM_ISA or
# JAX_BRGEMM_BF16 is a ValueError at import, not an error inside a compiled program.
try:
    _ISA = _jax_brgemm.isa()
except ValueError as e:
    if "JAX_BRGEMM_ISA" in str(e):
        raise _bad_isa(e) from None
    raise ValueError(str(e)) from None  # JAX_BRGEMM_BF16's message names it

#: name -> code of every activation the kernels fuse ("none" included), from C++.
ACTIVATION_CODES: dict[str, int] = dict(_jax_brgemm.activations())

#: The names of every XLA FFI target this package registers.
TARGETS: tuple[str, ...] = tuple(_jax_brgemm.registrations())

for _name, _capsule in _jax_brgemm.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

# Sizes the C++ layers decide and the Python side allocates: read from the extension, never
# computed twice.
lstm_saved_gates_shape = _jax_brgemm.lstm_saved_gates_shape
lstm_saved_width = _jax_brgemm.lstm_saved_width
lstm_da_width = _jax_brgemm.lstm_da_width
peak_flops_per_iter = _jax_brgemm.peak_flops_per_iter
#: "bfloat16" or "float32": the dtype the kernels multiply bfloat16 operands in.
bf16_multiply = _jax_brgemm.bf16_multiply


def isa() -> str:
    """The kernel ISA in use: "amx", "avx512", "avx2" or "generic" (JAX_BRGEMM_ISA lowers it)."""
    return _ISA


def export_safety_checks() -> list[jax.export.DisabledSafetyCheck]:
    """The ``disabled_checks`` that let ``jax.export`` serialize a function using the kernels.

    ``jax.export.export(jax.jit(f), disabled_checks=jb.export_safety_checks())``. jax.export
    refuses custom calls it does not know, since they are not guaranteed to be stable; the
    artifact calls this package's targets by name, so the process that runs it must have
    ``jax_brgemm`` (the same targets, with the same arguments) imported.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in TARGETS]
