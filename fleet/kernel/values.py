"""What the log can keep: text, integers and times every store accepts (decision 0023).

Every store keeps the same values and refuses the same ones with the same typed
error, and the kernel checks what it can before a step's effect runs, so a
refusal never lands after an effect it cannot record:

- **Text** must be valid Unicode: a lone surrogate (``"\\udcff"``, what
  ``os.listdir`` hands back for a file name that is not UTF-8) cannot be encoded
  as UTF-8 by SQLite or Postgres, so it is refused everywhere
  (``UnstorableValueError``). A NUL (``"\\x00"``) is fine inside a payload (JSON
  escapes it) but not in a key the index keeps (Postgres ``text`` cannot hold it):
  ids, flow ids, tenants, owners, gates, timer ids, holders.
- **Integers** the log keeps as numbers (sequences, timestamps, due times, lease
  expiries) fit in int64.
- **Times** are milliseconds since the epoch inside the log, up to 9999-12-31.
  Public APIs take an aware ``datetime`` (``ms_from_datetime``) and durations
  in seconds.

``printable`` makes caller-supplied text safe and short for an error message or
an audit record.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from fleet.kernel.errors import UnstorableValueError, ValidationError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# 9999-12-31T23:59:59.999Z: the last instant a datetime can name.
MAX_TIME_MS = 253_402_300_799_999
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def printable(value: Any, limit: int = 200) -> str:
    """``value`` as text that is valid Unicode, has no NUL and is at most ``limit`` chars.

    Lone surrogates and NUL become ``\\udcff`` / ``\\x00`` escapes; a longer text
    is cut and says how long it was.
    """
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` cannot be encoded as UTF-8 (it holds a lone surrogate)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_text(value: Any, what: str) -> str:
    """``value`` as a key the index keeps, or a typed refusal (see the module)."""
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise UnstorableValueError(
            f"{what} {printable(value, 80)!r} contains a NUL character (\\x00); no store "
            "keeps one in a key: remove it")
    if has_lone_surrogate(value):
        raise UnstorableValueError(
            f"{what} {printable(value, 80)!r} is not valid Unicode (a lone surrogate, e.g. "
            "a file name that was not UTF-8); decode it with errors='replace' or keep bytes "
            "as base64")
    return value


def check_int64(value: Any, what: str) -> int:
    """``value`` as an integer the log keeps (int64), or a typed refusal."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{what} must be an int, got {type(value).__name__} "
                              f"{printable(value, 60)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise UnstorableValueError(f"{what} {value} is outside int64; no store keeps it")
    return value


def check_ms(value: Any, what: str) -> int:
    """A time in milliseconds since the epoch, as a store takes it (int64, not a datetime)."""
    if isinstance(value, _dt.datetime):
        raise ValidationError(f"{what} is a datetime; the store API takes milliseconds since "
                              "the epoch (int). The Runtime takes datetimes: "
                              "runtime.fire_due_timers(now=...)")
    return check_int64(value, what)


def ms_from_datetime(when: Any, what: str) -> int:
    """An aware ``datetime`` as milliseconds since the epoch, or a typed refusal.

    Anything else is refused rather than guessed at: an int could be seconds or
    milliseconds, and a naive datetime could be any zone.
    """
    if not isinstance(when, _dt.datetime):
        hint = ""
        if isinstance(when, (int, float)) and not isinstance(when, bool):
            hint = (" (a number is ambiguous: seconds or milliseconds? For epoch seconds s "
                    "pass datetime.fromtimestamp(s, timezone.utc))")
        raise ValidationError(
            f"{what} must be an aware datetime, e.g. datetime.now(timezone.utc) + "
            f"timedelta(hours=1); got {type(when).__name__} {printable(when, 60)}{hint}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValidationError(
            f"{what} is a naive datetime ({when.isoformat()}); give it a zone, e.g. "
            "datetime.now(timezone.utc) or when.replace(tzinfo=timezone.utc)")
    ms = (when - _EPOCH) // _dt.timedelta(milliseconds=1)
    if ms < 0:
        raise UnstorableValueError(f"{what} {when.isoformat()} is before 1970; the log keeps "
                                   "times from the epoch on")
    return int(ms)


def datetime_from_ms(ms: int) -> _dt.datetime:
    """Milliseconds since the epoch as an aware UTC ``datetime`` (for messages and reports)."""
    return _EPOCH + _dt.timedelta(milliseconds=min(max(ms, 0), MAX_TIME_MS))


def seconds_of(value: Any, what: str) -> float:
    """A duration a public call takes (seconds as a number, or a ``timedelta``) in seconds,
    or a typed refusal: not a number, negative, NaN or infinite."""
    if isinstance(value, _dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{what} takes seconds (a number) or a timedelta, got "
                              f"{type(value).__name__} {printable(value, 60)}")
    else:
        seconds = float(value)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValidationError(f"{what} needs a finite duration, got {value!r}")
    if seconds < 0:
        raise ValidationError(f"{what} needs a duration of 0 or more, got {value!r}")
    return seconds


def due_after(now_ms: int, seconds: Any, what: str) -> int:
    """The time ``seconds`` after ``now_ms``, in ms, or a typed refusal past year 9999."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValidationError(f"{what} needs a number of seconds, got "
                              f"{type(seconds).__name__} {printable(seconds, 60)}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValidationError(f"{what} needs a finite number of seconds, got {seconds!r}")
    if seconds > (MAX_TIME_MS - now_ms) / 1000:
        raise UnstorableValueError(
            f"{what} of {seconds!r} s ends after 9999-12-31, the last time the log keeps; "
            "wait on a gate (ctx.wait) for something that may never come")
    return now_ms + max(0, int(seconds * 1000))


__all__ = ["INT64_MAX", "INT64_MIN", "MAX_TIME_MS", "check_int64", "check_ms", "check_text",
           "datetime_from_ms", "due_after", "has_lone_surrogate", "ms_from_datetime",
           "printable", "seconds_of"]
