"""Loads the native extension and registers its XLA FFI targets with JAX, once."""

import jax

from jax_brgemm import _jax_brgemm

# Decides the dispatch (ISA, bf16 multiply path) once, now: a bad JAX_BRGEMM_ISA or
# JAX_BRGEMM_BF16 is a ValueError at import, not an error inside a compiled program.
_jax_brgemm.isa()

for _name, _capsule in _jax_brgemm.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def isa() -> str:
    """The kernel ISA in use: "amx", "avx512", "avx2" or "generic" (JAX_BRGEMM_ISA lowers it)."""
    return _jax_brgemm.isa()
