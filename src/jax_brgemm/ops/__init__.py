"""Differentiable custom-call ops: each an XLA FFI call with a custom VJP."""
