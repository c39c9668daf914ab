"""One declared config key: its type, default, valid choices and documentation."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@attrs.frozen
class Option:
    """A config key. ``choices`` may be a callable so that it can list what plugins registered."""

    type: type
    default: Any
    doc: str
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    minimum: float | None = None
    maximum: float | None = None
    hint: Callable[[str], str] | None = None  # extra advice for a bad value (e.g. which pip install)
    secret: bool = False  # never printed (``erdma config show`` says only whether it is set)

    def valid_choices(self) -> list[Any] | None:
        if self.choices is None:
            return None
        return list(self.choices() if callable(self.choices) else self.choices)

    def coerce(self, key: str, value: Any, *, from_text: bool = False) -> Any:
        """Return ``value`` as this option's type, or raise ConfigError naming key, value and choices."""
        if from_text and isinstance(value, str):
            value = self._parse_text(key, value)
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise ConfigError(
                f"config key {key!r}: value {value!r} is a {type(value).__name__}, expected {self.type.__name__}"
            )
        if self.type is float and not math.isfinite(value):  # type: ignore[arg-type]  # (a float: checked above)
            raise ConfigError(f"config key {key!r}: value {value!r} is not a finite number")
        if self.minimum is not None and value < self.minimum:  # type: ignore[operator]  # (int or float)
            raise ConfigError(f"config key {key!r}: value {value!r} is below the minimum {self.minimum!r}")
        if self.maximum is not None and value > self.maximum:  # type: ignore[operator]
            raise ConfigError(f"config key {key!r}: value {value!r} is above the maximum {self.maximum!r}")
        choices = self.valid_choices()
        if choices is not None and value not in choices:
            raise ConfigError(
                f"config key {key!r}: invalid value {value!r}; valid choices: {', '.join(map(str, choices))}"
                + did_you_mean(str(value), [str(c) for c in choices])
                + (self.hint(str(value)) if self.hint else "")
            )
        return value

    def _parse_text(self, key: str, text: str) -> Any:
        if self.type is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ConfigError(f"config key {key!r}: value {text!r} is not a boolean; valid: true, false, 1, 0")
        if self.type in (int, float):
            try:
                return self.type(text)
            except ValueError:
                raise ConfigError(
                    f"config key {key!r}: value {text!r} is not a valid {self.type.__name__}"
                ) from None
        return text


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
