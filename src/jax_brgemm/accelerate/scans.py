"""The scans ``nn.scan`` makes, as ``accelerate()`` fuses them: over an LSTM cell class
(``nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params", ...)``) or over a module method
whose body is one LSTM cell step, as in Flax's sst2 example::

    class SimpleLSTM(nn.Module):
      @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1,
                         out_axes=1, split_rngs={"params": False})
      @nn.compact
      def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)

flax keeps a scan's settings only in the closure of the method it made
(``flax.linen.transforms.module_class_lift_transform`` / ``decorator_lift_transform``): no
public attribute says "this is a scan, over this, with these settings", and
``nn.intercept_methods`` sees only the body's calls inside the scan's trace, too late to fuse.
``lifted_scan`` is therefore the one place that reads such a closure.

Whether a body is exactly "one LSTM cell on the body's own ``(carry, x)``, its result returned
unchanged" is decided by ``lstm_step``: an abstract run (``jax.eval_shape``) of the
undecorated body on one time step that records the module calls it makes.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import flax.linen as nn
import jax
from flax.core import lift
from flax.core.scope import in_filter

from jax_brgemm.accelerate.state import probing
from jax_brgemm.nn._adapt import Decision

LSTM_CELLS = (nn.OptimizedLSTMCell, nn.LSTMCell)
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Scan:
    """A method ``nn.scan`` made: over a module class's ``__call__`` (``cell_class``) or over
    a decorated method (``body``, the undecorated one); ``settings`` nn.scan's keywords."""

    settings: dict = dataclasses.field(hash=False)
    cell_class: type | None = None
    body: Callable | None = None
    name: str = "__call__"  # the method's name in its class


def lifted_scan(method) -> Scan | None:
    """The ``Scan`` a method of a linen class is, None for anything else: a scan over an LSTM
    cell class's ``__call__``, or a decorated method scanned alone (read from flax's
    wrapper's closure)."""
    names = getattr(getattr(method, "__code__", None), "co_freevars", ())
    if "transform" not in names or "trafo_kwargs" not in names:
        return None
    try:
        free = {n: c.cell_contents for n, c in zip(names, method.__closure__ or ())}
    except (AttributeError, ValueError):  # no closure, or a cell not filled
        return None
    if (free.get("transform") is not lift.scan or free.get("trafo_args") != ()
            or not isinstance(free.get("trafo_kwargs"), dict)):
        return None
    settings = dict(free["trafo_kwargs"])
    if free.get("fn_name") == "__call__" and free.get("module_class") in LSTM_CELLS:
        return Scan(settings, cell_class=free["module_class"])
    bodies = free.get("prewrapped_fns")
    if free.get("multi_scope") and isinstance(bodies, (list, tuple)) and len(bodies) == 1:
        return Scan(settings, body=bodies[0])
    return None


# --- the scan settings the fused LSTM reproduces (shared with the class form) -------------


def scan_settings_why(scan: dict) -> str:
    """Why the parameters of an ``nn.scan`` with keyword arguments ``scan`` are not one set
    broadcast over time, read as is ("" when they are)."""
    if scan.get("variable_axes") or not in_filter(scan.get("variable_broadcast"), "params"):
        return "nn.scan whose parameters are not variable_broadcast (one set per step)"
    if in_filter(scan.get("variable_carry"), "params") or scan.get("data_transform") is not None:
        return "nn.scan with the parameters in variable_carry or a data_transform"
    return ""


def time_axis(axis, ndim: int):
    """An nn.scan in_axes / out_axes as 0 or 1 of a 3-D array, None for anything else."""
    if isinstance(axis, (tuple, list)) and len(axis) == 1:
        axis = axis[0]
    if not isinstance(axis, int) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        return None
    axis %= ndim
    return axis if axis in (0, 1) else None


# --- the probe -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Verdict:
    cell: Any  # an unbound copy of the body's cell (its fields), None when not fusable
    cell_name: str
    why: str


class _Recorder:
    """An ``nn.intercept_methods`` interceptor keeping the body's call (depth 0) and the
    calls it makes itself (depth 1); calls made by a ``setup`` count as extra calls."""

    def __init__(self):
        self.depth = self.in_setup = 0
        self.bodies, self.calls, self.extra = [], [], []

    def __call__(self, next_fun, args, kwargs, context):
        if context.method_name == "setup":
            self.in_setup += 1
            try:
                return next_fun(*args, **kwargs)
            finally:
                self.in_setup -= 1
        if self.in_setup:
            self.extra.append(type(context.module).__name__)
            return next_fun(*args, **kwargs)
        depth, self.depth = self.depth, self.depth + 1
        try:
            result = next_fun(*args, **kwargs)
        finally:
            self.depth -= 1
        if depth < 2:
            (self.bodies if depth == 0 else self.calls).append(
                (context.module, context.method_name, args, kwargs, result))
        return result


def _same_objects(a, b) -> bool:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    return tree_a == tree_b and all(x is y for x, y in zip(leaves_a, leaves_b))


def _judge(recorder: _Recorder) -> _Verdict:
    if len(recorder.bodies) != 1:
        return _Verdict(None, "", "the scanned method did not run as one call")
    body_module, _, body_args, body_kwargs, body_result = recorder.bodies[0]
    calls = recorder.calls
    if recorder.extra or len(calls) != 1:
        names = [f"{type(c[0]).__name__}.{c[1]}" for c in calls] + recorder.extra
        return _Verdict(None, "", f"the scanned method makes {len(names)} module calls "
                                  f"({', '.join(names) or 'none'}), not one LSTM cell call")
    cell, method, args, kwargs, result = calls[0]
    name = type(cell).__name__
    if type(cell) not in LSTM_CELLS or method != "__call__":
        return _Verdict(None, "", f"the scanned method calls {name}.{method}, not "
                                  f"OptimizedLSTMCell / LSTMCell")
    if cell.scope is None or cell.scope.path != body_module.scope.path + (cell.name,):
        return _Verdict(None, "", f"the scanned method's {name} is not its own submodule")
    if kwargs or body_kwargs or not _same_objects(tuple(args), tuple(body_args)):
        return _Verdict(None, "", f"the scanned method gives {name} other arguments than "
                                  f"its own (carry, x)")
    if not _same_objects(result, body_result):
        return _Verdict(None, "", f"the scanned method returns other than {name}'s result")
    return _Verdict(cell.clone(parent=None), cell.name, "")


def _probe(module, body, carry, x_step) -> _Verdict:
    """Runs ``body`` (the undecorated method) abstractly on one time step with the module's
    variables, recording its module calls."""
    root = module.clone(parent=None)
    rngs = {name: jax.random.key(0) for name in module.scope.rngs}
    recorder = _Recorder()

    def one_step(variables, carry, x):
        with nn.intercept_methods(recorder):
            return root.apply(variables, carry, x, method=body, rngs=rngs)

    try:
        with probing():
            jax.eval_shape(one_step, module.variables, carry, x_step)
    except Exception as error:  # noqa: BLE001 -- any failure keeps the stock scan
        return _Verdict(None, "", f"the scanned method's body could not be probed on one "
                                  f"time step ({type(error).__name__})")
    return _judge(recorder)


_verdicts: dict[Any, _Verdict] = {}
_MAX_VERDICTS = 256


def _abstract(tree):
    leaves, structure = jax.tree_util.tree_flatten(tree)
    return structure, tuple((getattr(a, "shape", None), str(getattr(a, "dtype", type(a))))
                            for a in leaves)


def _verdict(module, body, carry, x_step) -> _Verdict:
    """``_probe``'s verdict, cached per module class and fields, body and shapes / dtypes."""
    fields = tuple((f.name, getattr(module, f.name)) for f in dataclasses.fields(module)
                   if f.name not in ("parent", "name"))
    key = (type(module), body, fields, _abstract((carry, x_step)),
           _abstract(module.variables), tuple(module.scope.rngs))
    try:
        cached = _verdicts.get(key)
    except TypeError:  # a field that cannot be hashed: probe every call
        return _probe(module, body, carry, x_step)
    if cached is None:
        cached = _probe(module, body, carry, x_step)
        with _lock:
            if len(_verdicts) >= _MAX_VERDICTS:
                _verdicts.clear()
            _verdicts[key] = cached
    return cached


def lstm_step(module, body, carry, inputs, axis: int) -> Decision:
    """``Decision((cell, its parameters))`` when the scanned method ``body`` of ``module``,
    called on ``(carry, inputs)`` (time along ``axis``), computes one step of an
    OptimizedLSTMCell / LSTMCell on its own ``(carry, x)`` and returns its result
    unchanged."""
    if module.scope.mutable:
        return Decision.stock("a variable collection is mutable in this apply (the scanned "
                              "method could write to it)")
    x_step = jax.ShapeDtypeStruct(inputs.shape[:axis] + inputs.shape[axis + 1:], inputs.dtype)
    verdict = _verdict(module, body, carry, x_step)
    if verdict.cell is None:
        return Decision.stock(verdict.why)
    params = module.variables.get("params", {}).get(verdict.cell_name)
    if params is None:
        return Decision.stock("parameters not created yet")
    return Decision((verdict.cell, params))
