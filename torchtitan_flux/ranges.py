"""``Range``: the allowed values of a numeric config field, declared on its type in ``config.py``
(``Annotated[int, Range(ge=2)]``); ``run/validation.py`` checks them and docs/configuration.md prints them."""

import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric field (at most one lower and one upper; None: unbounded) and what a special value means."""

    ge: float | None = None
    """Inclusive lower bound."""

    gt: float | None = None
    """Exclusive lower bound."""

    le: float | None = None
    """Inclusive upper bound."""

    lt: float | None = None
    """Exclusive upper bound."""

    note: str = ""
    """What a special value in the range means, printed after the bounds, e.g. "0 disables"."""

    def contains(self, v: float) -> bool:
        """``v`` is within every declared bound."""
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def describe(self, integer: bool) -> str:
        """The allowed values in words, as the errors and the docs give them: "an integer >= 1", "a number in (0, 1]",
        "an integer >= 0 (0 disables)"; ``integer``: the field is an int."""
        kind = "an integer" if integer else "a number"
        ops = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        bounds = [(op, bound if integer else f"{bound:g}") for op, bound in ops if bound is not None]
        if len(bounds) == 2:  # lower first
            (low_op, low), (high_op, high) = bounds
            text = f"{kind} in {'[' if low_op == '>=' else '('}{low}, {high}{']' if high_op == '<=' else ')'}"
        else:
            ((op, bound),) = bounds
            text = f"{kind} {op} {bound}"
        return f"{text} ({self.note})" if self.note else text


def field_ranges(cls: type) -> dict[str, tuple[Range, str]]:
    """The fields of dataclass ``cls`` that declare a ``Range``: name -> (the range, its allowed values in words)."""
    out = {}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        for meta in getattr(tp, "__metadata__", ()):
            if isinstance(meta, Range):  # ``int | None``: None is the unset value, outside every range
                out[name] = (meta, meta.describe(integer=int in (typing.get_args(tp)[0], *typing.get_args(typing.get_args(tp)[0]))))
    return out
