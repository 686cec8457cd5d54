"""Hyperparameters: defaults, the closed division's table of tunables, validation.

A benchmark's hyperparameters are a flat dict keyed by MLPerf log names
(``opt_name``, ``opt_base_learning_rate``, ``global_batch_size``, ...). Its
closed-division table lists, per optimizer, the tunable keys with their
constraints; every other key must keep the reference value (MLPerf: "by default,
the hyperparameters must be the same as the reference"). The same constraint
objects validate a configuration here and render the compliance checker's
CHECK expressions (see compliance.py), so the two cannot disagree.
"""

import dataclasses
import numbers
from typing import Any, Mapping, Optional, Sequence

from . import optim


class HparamError(Exception):
    """A configuration breaks a rule (exit code 2). ``rule`` names the rule."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[rule {rule}] {message}")
        self.rule = rule


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Range:
    """lo <= x <= hi (either bound optional, ``lo_open`` makes it lo < x)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    integer: bool = False
    lo_open: bool = False

    def check(self, x) -> bool:
        if not _is_number(x) or (self.integer and not isinstance(x, numbers.Integral)):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or x <= self.hi

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo}"
        hi = "" if self.hi is None else f"<= {self.hi}"
        return f"{kind} " + " and ".join(b for b in (lo, hi) if b)

    def expr(self, x: str) -> str:
        kind = "int" if self.integer else "(int, float)"
        parts = [f"isinstance({x}, {kind})", f"not isinstance({x}, bool)"]
        if self.lo is not None:
            parts.append(f"{x} {'>' if self.lo_open else '>='} {self.lo!r}")
        if self.hi is not None:
            parts.append(f"{x} <= {self.hi!r}")
        return "(" + " and ".join(parts) + ")"


@dataclasses.dataclass(frozen=True)
class OneOf:
    """x is one of ``values`` (compared with type, so True is not 1)."""

    values: Sequence[Any]

    def check(self, x) -> bool:
        return any(type(x) is type(v) and x == v for v in self.values)

    def describe(self) -> str:
        return f"one of {list(self.values)}"

    def expr(self, x: str) -> str:
        types = sorted({type(v).__name__ for v in self.values})
        return f"(type({x}).__name__ in {types!r} and {x} in {list(self.values)!r})"


SCHEDULE_KEY = "opt_learning_rate_decay_schedule"


def defaults(bench, opt_name: str, schedule: Optional[str] = None) -> dict[str, Any]:
    """Reference hyperparameters of ``bench`` for optimizer ``opt_name`` and decay
    ``schedule`` (default: the reference schedule), with that schedule's own keys."""
    common = bench.hparams["common"]
    schedule = common[SCHEDULE_KEY] if schedule is None else schedule
    return {**common, SCHEDULE_KEY: schedule, **optim.SCHEDULE_OPTIONS[schedule],
            "opt_name": opt_name, **optim.OPTIMIZERS[opt_name].defaults,
            **bench.hparams.get(opt_name, {})}


def _is_scalar(x) -> bool:
    return isinstance(x, (str, bool, numbers.Real))


def closed_optimizers(bench) -> list[str]:
    return [k for k in bench.tunable if k != "common"]


def _same_type(value, default) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    if isinstance(default, numbers.Integral):
        return isinstance(value, numbers.Integral)
    if isinstance(default, numbers.Real):
        return _is_number(value)
    return type(value) is type(default)


def resolve(bench, overrides: Mapping[str, Any], division: str) -> dict[str, Any]:
    """Merges ``overrides`` into the reference hyperparameters and validates them.

    Both divisions: known optimizer, known keys, right types, a usable schedule.
    Closed division also: an approved optimizer from the benchmark's table,
    tunable keys within their constraints, every other key at its reference value.
    """
    if division not in ("closed", "open"):
        raise HparamError("division", f"division must be 'closed' or 'open', got {division!r}")
    for key, value in overrides.items():
        if not _is_scalar(value):
            raise HparamError("hyperparameter-type",
                              f"{key}={value!r} has the wrong type: a hyperparameter is a JSON "
                              f"number, boolean or string")
    opt_name = overrides.get("opt_name", bench.hparams["common"]["opt_name"])
    if opt_name not in optim.OPTIMIZERS:
        raise HparamError("known-optimizer", f"opt_name {opt_name!r} is not an optimizer this "
                          f"harness implements: {sorted(optim.OPTIMIZERS)}")
    if division == "closed" and opt_name not in closed_optimizers(bench):
        raise HparamError(
            "closed/approved-optimizer",
            f"opt_name {opt_name!r} is not allowed in the closed division of {bench.name}; "
            f"allowed: {closed_optimizers(bench)} (MLPerf closed division: the optimizer must "
            f"be one of the allowed optimizers; use --division open to experiment)")

    schedule = overrides.get(SCHEDULE_KEY, bench.hparams["common"][SCHEDULE_KEY])
    if schedule not in optim.DECAY_SCHEDULES:
        raise HparamError("schedule", f"{SCHEDULE_KEY} must be one of "
                          f"{list(optim.DECAY_SCHEDULES)}, got {schedule!r}")
    reference = defaults(bench, opt_name, schedule)
    unknown = sorted(set(overrides) - set(reference))
    if unknown:
        raise HparamError("known-hyperparameter",
                          f"unknown hyperparameter(s) {unknown} for optimizer {opt_name!r} "
                          f"with the {schedule} schedule; known: {sorted(reference)}")
    hp = {**reference, **overrides}
    for key, value in hp.items():
        if not _same_type(value, reference[key]):
            raise HparamError("hyperparameter-type",
                              f"{key}={value!r} has the wrong type; expected a "
                              f"{type(reference[key]).__name__} like {reference[key]!r}")
    _check_schedule(hp)

    if division == "closed":
        table = {**bench.tunable["common"], **bench.tunable[opt_name]}
        for key, value in hp.items():
            if key in table:
                if not table[key].check(value):
                    raise HparamError(
                        "closed/tunable-constraint",
                        f"{key}={value!r} is out of range for {bench.name}: must be "
                        f"{table[key].describe()} (MLPerf closed division: tunable "
                        f"hyperparameters must meet the table's constraints)")
            elif value != reference[key]:
                raise HparamError(
                    "closed/fixed-hyperparameter",
                    f"{key} is not tunable in the closed division of {bench.name}: it must keep "
                    f"the reference value {reference[key]!r}, got {value!r} (MLPerf closed "
                    f"division: hyperparameters must be the same as the reference)")
    return hp


def _check_schedule(hp):
    positive = ("global_batch_size", "opt_base_learning_rate", "opt_learning_rate_decay_epochs")
    for key in positive:
        if not hp[key] > 0:
            raise HparamError("schedule", f"{key} must be positive, got {hp[key]!r}")
    for key in ("opt_end_learning_rate", "opt_learning_rate_warmup_epochs"):
        if hp[key] < 0:
            raise HparamError("schedule", f"{key} must not be negative, got {hp[key]!r}")
    if hp["opt_learning_rate_warmup_epochs"] >= hp["opt_learning_rate_decay_epochs"]:
        raise HparamError("schedule", "opt_learning_rate_warmup_epochs must be smaller than "
                          "opt_learning_rate_decay_epochs (the decay ends after the warmup)")
