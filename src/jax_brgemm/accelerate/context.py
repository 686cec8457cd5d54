"""The ``accelerate()`` context, the package's top floor: entering one (the outermost of the
process) installs the interception (``patches``), and the last exit removes it, so flax is
exactly itself outside; inside, a call is intercepted by this thread's state only (``state``).
"""

from __future__ import annotations

import contextlib
import warnings

from jax_brgemm.accelerate import patches
from jax_brgemm.accelerate.state import CACHE_KEY, Call, Options, state


class Accelerate(contextlib.ContextDecorator):
    """The context manager (and decorator) that ``accelerate()`` returns.

    Attributes:
      calls: every distinct layer call traced inside the context, in order.
      report: print ``calls`` when the context exits.
      policy: leave the calls ``jax_brgemm.accelerate.policy`` names to stock XLA.
    """

    def __init__(self, report: bool = False, policy: bool = True):
        self.report = report
        self.policy = policy
        self.calls: list[Call] = []

    def __enter__(self):
        self.calls = []
        patches.acquire()
        entered = contextlib.ExitStack()
        entered.enter_context(CACHE_KEY(Options(self.policy)))
        if not state.contexts:  # linen's interceptors are per thread already
            entered.enter_context(patches.linen_interception())
        state.contexts.append(self)
        state.entered.append(entered)
        return self

    def __exit__(self, *exc):
        assert state.contexts.pop() is self
        state.entered.pop().close()
        patches.release()
        if self.report:
            print(self.summary())
            if not self.calls and exc[0] is None:
                warnings.warn(_NOTHING_SEEN, stacklevel=2)
        return False

    def summary(self) -> str:
        fast = sum(c.accelerated for c in self.calls)
        lines = [f"jax_brgemm.accelerate: {fast} of {len(self.calls)} layer calls on the kernels"]
        steps = sum(c.accelerated and bool(c.step_of) for c in self.calls)
        if steps:
            lines[0] += (f"; {steps} of them are layers inside stock recurrent scans, on the "
                         f"kernels once per time step (the recurrence itself runs stock)")
        return "\n".join(lines + [f"  {c}" for c in self.calls])


def accelerate(report: bool = False, policy: bool = True) -> Accelerate:
    """Runs the supported stock Flax layers traced inside the context on the kernels.

    Covers ``flax.linen.Dense`` (any input rank; float32 or bfloat16 computation),
    ``flax.linen.DenseGeneral`` over the input's trailing axes (without ``batch_dims``),
    ``flax.linen.Einsum`` whose equation is a matrix product (``"...d,dnh->...nh"``),
    ``flax.linen.Embed.attend`` (a tied embedding's logits, ``jb.ops.dense.attend``: the
    table read as it is stored), ``jax.nn.gelu`` (also as ``flax.linen.gelu`` and
    ``flax.nnx.gelu``; its derivative on the kernels, ``jb.ops.eltwise.gelu``),
    ``flax.linen.MultiHeadDotProductAttention`` (its attention on ``jb.dot_product_attention``
    with a float32 softmax and attention dropout, its projections as DenseGeneral; stock for
    a custom ``attention_fn`` or einsums, ``decode`` and ``sow_weights``),
    ``flax.linen.Conv`` (1-D, 2-D and 3-D; dense, grouped, depthwise, kernel- and
    input-dilated; every padding form, a negative pad cropping, strides, masks; float32 or
    bfloat16), ``flax.linen.ConvTranspose`` (likewise, ``transpose_kernel`` and
    ``'CIRCULAR'`` too) and ``flax.linen.RNN`` over ``OptimizedLSTMCell`` or
    ``LSTMCell`` (the whole sequence as one fused ``jb.lstm`` call on the cell's parameters).
    A call falls back to the stock module, unchanged, for a custom ``dot_general`` /
    ``dot_general_cls`` / ``conv_general_dilated`` / ``promote_dtype``, a computation dtype
    other than float32 or bfloat16, a ``precision`` outside ``jax_brgemm.precision``'s table,
    or a subclass of the layer (e.g. ``ConvLocal``); a Conv also for a padding that crops
    the whole input or more than 3 spatial dims; an RNN also for other cells (or subclasses of these), gate / activation functions other
    than sigmoid / tanh, non-default scan settings (``variable_axes``,
    ``variable_broadcast``, ``variable_carry``), inputs without a batch dim, and
    ``seq_lengths`` with ``return_carry=True`` over more than one batch dim.
    ``nn.scan(OptimizedLSTMCell or LSTMCell, variable_broadcast="params", ...)`` (Flax's
    sst2 pattern), called on ``(carry, inputs)``, runs fused too, for ``reverse`` either way
    and the time axis 0 or 1 of 3-D inputs and outputs (``in_axes`` / ``out_axes``); stock,
    listed with the reason, for per-step or carried parameters, a ``data_transform``, other
    axes or shapes. So does ``nn.scan`` over a module method whose body only calls one such
    cell on its own ``(carry, x)`` and returns the cell's result (the sst2 example's
    ``SimpleLSTM``); a body that does anything more stays stock, listed with the reason.

    NNX models are covered alike: ``flax.nnx.Linear``, ``Conv``, ``ConvTranspose`` and ``RNN``
    over ``OptimizedLSTMCell`` / ``LSTMCell`` (what ``jax_brgemm.nnx`` runs on the kernels,
    see there), ``flax.nnx.MultiHeadAttention`` as linen's (``num_kv_heads`` and
    ``is_causal`` too), ``LinearGeneral`` (without ``batch_axis``), ``Einsum`` and ``Embed.attend``
    as linen's DenseGeneral, Einsum and Embed.attend, under ``jax.jit``, ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` and
    ``nnx.scan``.

    Where the kernels take a call but lose to stock XLA on this CPU, the call stays stock,
    with the reason in the report: ``jax_brgemm.accelerate.policy.TABLE``, fixed at import from the
    CPU's ISA (float32 Dense-like layers over fewer rows than the ISA's line, 64 with
    AVX-512 and 512 elsewhere, whose dots XLA overlaps with the optimizer step; larger or
    bfloat16 ones, convolutions, LSTMs and attention run on the kernels). ``policy=False``
    runs every call the kernels take on them.

    ``report=True`` prints, on exit, which calls ran on the kernels and why the others did
    not (also in ``.calls``; NNX layers, which have no path, by class and sizes), and for a
    call whose ``precision`` (or ``jax.default_matmul_precision``) asks other than float32,
    the accuracy computed (``jax_brgemm.precision``: exact float32 unless emulated); it warns
    when the context saw no layer call at all. A recurrent cell run step by step (a stock
    ``nn.scan`` over a cell or a method, a stock RNN fallback, a loop) is listed with its
    reason, and the layers inside it, which run on the kernels once per time step, say so.

    Only code traced inside the context runs on the kernels, and all of it does, in the
    thread that entered it: the context (with its ``policy``) is part of what ``jax.jit``'s
    caches key on (``jax.make_user_context``), so a function jitted and traced before is
    traced again inside, and its first trace runs again after. Outside every context flax
    is exactly itself (``patches``).

    Usable as ``with jax_brgemm.accelerate(): ...`` or as a decorator.
    """
    return Accelerate(report, policy)


_NOTHING_SEEN = (
    "jax_brgemm.accelerate(report=True) saw no layer call: nothing was traced inside the "
    "context. The likely cause: a jitted function already traced inside an equal context "
    "ran from jax.jit's cache (its program is on the kernels, but nothing was recorded), or "
    "it ran in another thread, or the model has no flax Dense / Linear, Conv or RNN layers.")
