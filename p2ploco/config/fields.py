"""What a config key may hold: its type (``Number``, ``Text``, ``Paths``), its bounds (``bound``), the limits the
sections share, and ``Section``, the strict base of every part of the config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

MIN_PEER_TTL = 8.0  # seconds; hivemind's DHT waits up to 3 s for a peer in a lookup
MAX_WAIT = 3600.0  # seconds: the longest any one wait of a round may be set to (every wait is bounded)
MAX_STARTUP_WAIT = 86400.0
MAX_BAN_ROUNDS = 1000
# The most members that reduce spans of one slice (``swarm.max_reducers``; a group of more draws that many,
# ``sync/group.py``), and its bounds: fewer hands one key a quarter of a slice or more, more makes every member
# read that many receipts of every member a round
MAX_REDUCERS = 32
REDUCERS_BOUNDS = (4, 1024)
MAX_GROUP_SIZE = 1 << 20  # LoCo's quantization groups: one scale per at most this many values


class OutOfBounds(ValueError):
    """A value of its field's type outside the field's bounds. ``line`` reads it once ``{key}`` (the dotted key) and
    ``{value}`` (the value as the field holds it: 1 set for a number reads 1.0) are filled in."""

    def __init__(self, line: str, value: Any):
        super().__init__(line)
        self.line, self.value = line, value


def bound(holds: Callable[[Any], bool], line: str) -> AfterValidator:
    """A field's bound: ``holds`` tells whether a value that has the field's type is within it. (A check on the
    value as held, not ``Field(gt=...)``: pydantic's constraint errors carry the value as given, 1 where the line
    must show 1.0.)"""
    def check(value: Any) -> Any:
        if not holds(value):
            raise OutOfBounds(line, value)
        return value

    return AfterValidator(check)


def _number_from_text(value: Any) -> Any:
    """YAML 1.1 reads 3e-4 (an exponent without a dot) as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _text_from_number(value: Any) -> Any:
    """YAML reads a name such as 7 or 1.5 as a number."""
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


# An integer set for a number is held as a float; no key of the config means anything with NaN or infinity.
Number = Annotated[float, BeforeValidator(_number_from_text), Field(allow_inf_nan=False)]
Text = Annotated[str, BeforeValidator(_text_from_number)]
# one path may be given without the list around it
Paths = Annotated[list[Text], BeforeValidator(lambda value: [value] if isinstance(value, str) else value)]

LearningRate = Annotated[Number, bound(lambda lr: lr > 0, "{key} ({value}) must be > 0")]
Momentum = Annotated[Number, bound(lambda m: 0 <= m < 1, "{key} ({value}) must be in [0, 1)")]  # of a moving average
Fraction = Annotated[Number, bound(lambda f: 0 <= f <= 1, "{key} ({value}) must be in [0, 1]")]


STRICT = ConfigDict(strict=True)  # an int is no float and no bool, a number is no bool, a string no number


class Section(BaseModel):
    """A part of the config, a value once built: strict types, no unknown keys."""

    model_config = ConfigDict(**STRICT, extra="forbid", frozen=True)
