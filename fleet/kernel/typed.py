"""Typed values: pydantic models and dataclasses through the log (issue 26 item 9).

The log keeps JSON. A value a flow gives the kernel (a step's result, a flow's
input or output, a message, a value, a reply) may be a pydantic model or a
dataclass, anywhere inside it: it is stored as its JSON form (``model_dump(mode=
"json")``). Where the code says what type it wants back, it gets that type:

- a step's result, by the step function's return annotation (``-> Order``): the
  live run and every replay get an ``Order`` built from what the log holds;
- a flow's input, by the annotation of its body's second parameter, checked when
  the execution is started (a bad input is refused, nothing written), and its
  output by the body's return annotation (``runtime.result``, a parent's
  ``ctx.child``);
- a message, a gate's answer, a value or an update's reply, by the ``type=`` the
  reader passes (``ctx.receive(key, type=Order)``, ``runtime.get_value(...,
  type=)``...).

Conversion goes through pydantic's ``TypeAdapter`` (dataclasses, ``datetime``,
``UUID``, ``Enum``, unions and containers of them), built once per function.
Anything else is stored only if it is JSON already, as before (a set or a
datetime with no annotation to bring it back is refused: a replay would see
something else than the live run did).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import decimal
import enum
import json
import typing
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from fleet.kernel.errors import NotSerializableError, ValidationError
from fleet.kernel.events import ensure_json
from fleet.kernel.values import has_lone_surrogate, printable

_RICH = (BaseModel, _dt.date, _dt.time, _dt.timedelta, uuid.UUID, decimal.Decimal, enum.Enum)
_MISSING = object()
# Resolved return / input adapters by code object (closures of one def share them).
_RETURNS: dict[Any, TypeAdapter[Any] | None] = {}
_PARAMS: dict[Any, TypeAdapter[Any] | None] = {}


def _is_rich(annotation: Any) -> bool:
    """Whether ``annotation`` names a type JSON does not bring back by itself."""
    if isinstance(annotation, type):
        return issubclass(annotation, _RICH) or dataclasses.is_dataclass(annotation)
    return any(_is_rich(arg) for arg in typing.get_args(annotation))


def adapter_for(annotation: Any) -> TypeAdapter[Any] | None:
    """A ``TypeAdapter`` for ``annotation`` when it needs one (a model, a dataclass...)."""
    if annotation is None or annotation is _MISSING or not _is_rich(annotation):
        return None
    try:
        return TypeAdapter(annotation)
    except Exception as exc:
        raise ValidationError(f"fleet cannot store values of type {annotation!r}: "
                              f"{printable(exc, 300)}") from exc


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an unresolvable annotation converts nothing
        return {}


def return_adapter(fn: Callable[..., Any]) -> TypeAdapter[Any] | None:
    """The adapter of ``fn``'s return annotation, if it needs one (cached per code)."""
    annotations = getattr(fn, "__annotations__", None)
    if not annotations or "return" not in annotations:
        return None
    key = getattr(fn, "__code__", fn)
    if key not in _RETURNS:
        _RETURNS[key] = adapter_for(_hints(fn).get("return", _MISSING))
    return _RETURNS[key]


def input_adapter(body: Callable[..., Any]) -> TypeAdapter[Any] | None:
    """The adapter of a flow body's input (its second parameter's annotation)."""
    annotations = getattr(body, "__annotations__", None)
    if not annotations:
        return None
    key = getattr(body, "__code__", body)
    if key not in _PARAMS:
        names = list(getattr(getattr(body, "__code__", None), "co_varnames", ()))
        argc = getattr(getattr(body, "__code__", None), "co_argcount", 0)
        name = names[1] if argc >= 2 and len(names) >= 2 else None
        _PARAMS[key] = adapter_for(_hints(body).get(name, _MISSING)) if name else None
    return _PARAMS[key]


def _plain(value: Any) -> Any:
    """The C encoder's ``default``: a model or a dataclass as its JSON form."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return TypeAdapter(type(value)).dump_python(value, mode="json")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                            default=_plain)


def to_log(value: Any, what: str, adapter: TypeAdapter[Any] | None = None) -> Any:
    """``value`` as the log keeps it: through ``adapter`` when given, else with every model
    and dataclass in it as its JSON form; refused as ``ensure_json`` refuses (typed)."""
    if adapter is not None:
        try:
            value = adapter.dump_python(value, mode="json")
        except Exception as exc:
            raise NotSerializableError(f"{what} is not a {adapter_name(adapter)}: "
                                       f"{printable(exc, 300)}") from exc
        return ensure_json(value, what)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ensure_json(value, what)
    if isinstance(value, (BaseModel, dict, list)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)):
        try:
            text = _ENCODER.encode(value)
        except (TypeError, ValueError, RecursionError) as exc:
            raise NotSerializableError(
                f"{what} is not JSON-serialisable ({printable(exc, 300)}); use plain dicts, "
                "lists, str, int, float, bool, None, pydantic models or dataclasses") from exc
        if has_lone_surrogate(text):
            return ensure_json(value, what)  # the same refusal, said the same way
        return json.loads(text)
    return ensure_json(value, what)


def encode_input(body: Callable[..., Any], value: Any, what: str) -> Any:
    """A flow's input as its start records it: through the body's input annotation when it
    has one (checked: an input that is not of that type is refused before anything is
    written), else as ``to_log``."""
    adapter = input_adapter(body)
    if adapter is None:
        return to_log(value, what)
    if not isinstance(value, (dict, list, str, int, float, bool, type(None))):
        return to_log(value, what, adapter)
    recorded = to_log(from_log(value, adapter, what), what, adapter)  # JSON given: checked
    return recorded


def from_log(value: Any, adapter: TypeAdapter[Any] | None, what: str) -> Any:
    """A value from the log, as ``adapter``'s type (unchanged without one)."""
    if adapter is None:
        return value
    try:
        return adapter.validate_python(value)
    except PydanticValidationError as exc:
        raise ValidationError(f"{what} is not a {adapter_name(adapter)}: "
                              f"{printable(exc.errors()[:2], 300)}") from exc


def reader(type_: Any) -> TypeAdapter[Any] | None:
    """The adapter a reader's ``type=`` asks for (None: the JSON as stored)."""
    if type_ is None:
        return None
    try:
        return TypeAdapter(type_)
    except Exception as exc:
        raise ValidationError(f"type={type_!r} is not a type fleet can read values as: "
                              f"{printable(exc, 300)}") from exc


def adapter_name(adapter: TypeAdapter[Any]) -> str:
    core = getattr(adapter, "_type", None)
    return getattr(core, "__name__", None) or repr(core)


__all__ = ["adapter_for", "encode_input", "from_log", "input_adapter", "reader",
           "return_adapter", "to_log"]
