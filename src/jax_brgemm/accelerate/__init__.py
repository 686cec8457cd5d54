"""``jax_brgemm.accelerate()``: run an unmodified Flax model's layers on the BRGEMM kernels.

Inside the context, every call of a Flax layer the kernels support (linen's Dense, Conv,
LSTM RNN and scans, attention, DenseGeneral and Einsum; their NNX twins) computes with the
code of ``jax_brgemm.nn`` / ``jax_brgemm.nnx`` on exactly the parameters the stock module
created; everything else runs the stock module unchanged. Parameter creation (linen's
``init``, NNX constructors) always runs the stock code, so the parameter trees, and
checkpoints, are the stock ones by construction::

    model = MyFlaxModel()                      # written against flax.linen only
    params = model.init(key, x)                # the same tree inside the context or not
    apply = jax.jit(model.apply)
    y = apply(params, x)                       # stock XLA
    with jax_brgemm.accelerate():
        y = apply(params, x)                   # on the kernels: traced again, for the context
    y = apply(params, x)                       # stock again (its first trace, from the cache)

The package, in floors, each module importing only those below it: ``state`` (the contexts
entered in this thread, the jit-cache key, the report's records) and the dispatch ``policy``;
the rules (``scans``, ``rules``, ``attention``, ``recurrent``); ``dispatch`` (the rule table,
from a rule's decision to the result); ``patches`` (what is replaced in flax while a context
is open); ``context`` (``accelerate()`` itself).
"""

from jax_brgemm.accelerate.context import Accelerate, accelerate
from jax_brgemm.accelerate.state import Call

__all__ = ["Accelerate", "Call", "accelerate"]
