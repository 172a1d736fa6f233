"""Flows: ``@flow`` makes a ``FlowDefinition``; the structural hash and the code check.

The structural hash covers the flow id, version, deadline and declared steps
(ADR 0113 D1): ``sha256:`` + SHA-256 of their canonical JSON, or the legacy
``fnv1a:`` + FNV-1a 32 of the same bytes. New starts, migrations and
continuation successors record the legacy form unless
``Features(sha256_flow_hash=True)`` (default off: a node that predates the
flag would refuse every ``sha256:`` recording); both forms are always read.

The structural hash selects the registered version a log was recorded by; then
the body fingerprint (``codeHash``, D2) is compared: equal, or absent on either
side, replays; a different one is refused with ``FlowCodeMismatchError`` unless
the version lists it in ``compatible_with``.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import ConfigurationError, FlowCodeMismatchError, FlowNotFoundError
from fleet.kernel.fingerprint import AUTO, auto_fingerprint

FlowBody = Callable[..., Awaitable[Any]]

_ID = re.compile(r"^[A-Za-z0-9_.:\-/]{1,200}$")


@dataclass(frozen=True, slots=True)
class Features:
    """Fleet-wide switches that change what new executions record."""

    sha256_flow_hash: bool = False


@dataclass(frozen=True)
class FlowDefinition:
    """A registered flow: its body and the structure its hash covers."""

    flow_id: str
    version: int
    body: FlowBody
    steps: tuple[str, ...] = ()
    deadline: float | None = None  # seconds from start
    code_fingerprint: str | None = None
    compatible_with: tuple[str, ...] = ()
    step_families: tuple[str | re.Pattern[str], ...] = ()
    _hashes: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # runtime.update's validators by message key (``@my_flow.validator("key")``).
    validators: dict[str, Callable[[Any], Any]] = field(default_factory=dict, compare=False,
                                                        repr=False)

    def canonical(self) -> str:
        """The canonical structure both hashes are computed over."""
        return json.dumps({"id": self.flow_id, "version": self.version,
                           "deadline": self.deadline, "steps": list(self.steps)},
                          separators=(",", ":"), sort_keys=True)

    def content_hash(self, features: Features = Features()) -> str:
        """The structural hash new recordings carry: ``sha256:`` iff the flag is on."""
        return self.sha256_hash if features.sha256_flow_hash else self.legacy_hash

    @property
    def sha256_hash(self) -> str:
        h = self._hashes.get("sha256")
        if h is None:
            h = "sha256:" + sha256_hex(self.canonical().encode())
            self._hashes["sha256"] = h
        return h

    @property
    def legacy_hash(self) -> str:
        h = self._hashes.get("fnv1a")
        if h is None:
            h = f"fnv1a:{fnv1a_32(self.canonical().encode()):08x}"
            self._hashes["fnv1a"] = h
        return h

    def matches_hash(self, recorded: str | None) -> bool:
        """Whether a recorded flow hash (either form) names this structure."""
        return flow_hash_matches(recorded, self)

    def accepts_code(self, recorded: str | None) -> bool:
        """Whether this version may replay a log recorded with fingerprint ``recorded``.

        Equal, or absent on either side (a flow without a fingerprint behaves
        as before ADR 0113), or listed in ``compatible_with``.
        """
        return (not recorded or not self.code_fingerprint or recorded == self.code_fingerprint
                or recorded in self.compatible_with)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return await self.body(*args, **kwargs)

    def validator(self, key: str) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
        """Register a validator for ``runtime.update(execution_id, key, payload)``: it is
        called with the payload before anything is written, and refuses the update by
        raising (the caller gets ``UpdateFailedError``); it may be ``async``. Not part of
        the flow's hash: it runs in the caller's process, never in a replay."""
        def register(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            self.validators[key] = fn
            return fn
        return register


def sha256_hex(data: bytes) -> str:
    """SHA-256 (FIPS 180-4) as 64 lowercase hex digits: the ``sha256:`` flow hash."""
    return hashlib.sha256(data).hexdigest()


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32 bits: the legacy flow hash, still read for old logs."""
    h = 0x811C9DC5
    for byte in data:
        h ^= byte
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


def flow_content_hash(definition: FlowDefinition, features: Features = Features()) -> str:
    """The structural hash a new recording of ``definition`` carries under ``features``."""
    return definition.content_hash(features)


def flow_hash_matches(recorded: str | None, definition: FlowDefinition) -> bool:
    """Whether ``recorded`` (``sha256:`` or legacy ``fnv1a:``) names ``definition``'s structure.

    The form is read from the prefix and that form is recomputed, so a legacy
    recording matches whatever the flag says new ones record. ``None`` (a log
    that recorded no hash) matches; an unknown prefix does not.
    """
    if recorded is None:
        return True
    if recorded.startswith("sha256:"):
        return recorded == definition.sha256_hash
    if recorded.startswith("fnv1a:"):
        return recorded == definition.legacy_hash
    return False


def load_flow(spec: str) -> FlowDefinition:
    """``package.module:flow_name`` → the ``FlowDefinition`` it names.

    Every fleet process (worker, dispatcher, timer service, CLI) registers the
    flows ``FleetSettings.flows`` lists through this.

    Raises:
        ConfigurationError: the spec is malformed, the module does not import,
            or the attribute is not a flow declared with ``@flow``.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"flow {spec!r} must look like 'package.module:flow_name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    definition = getattr(module, attr, None)
    if not isinstance(definition, FlowDefinition):
        raise ConfigurationError(f"{spec!r} is not a flow declared with @flow(...)")
    return definition


def load_flows(specs: Sequence[str]) -> list[FlowDefinition]:
    """``load_flow`` of each spec, in order (a ``FleetSettings.flows`` list)."""
    return [load_flow(spec) for spec in specs]


def flow(flow_id: str, *, version: int = 1, steps: Sequence[str] = (),
         deadline: float | None = None, code_fingerprint: str | None = None,
         compatible_with: Sequence[str] = (),
         step_families: Sequence[str | re.Pattern[str]] = (),
         ) -> Callable[[FlowBody], FlowDefinition]:
    """Declare a flow.

    Args:
        flow_id: a stable name; executions record it.
        version: bump when the declared structure changes.
        steps: the step ids the body may ask for (``id#n`` dynamic ids belong
            to the family ``id``).
        deadline: seconds from start after which the execution fails.
        code_fingerprint: an opt-in fingerprint of the body, recorded as
            ``codeHash`` on EXECUTION_STARTED and compared whenever the
            execution is driven again. A string your toolchain computes, or
            ``"auto"``: ``auto:`` + SHA-256 of the body's syntax tree without
            docstrings, comments, formatting or decorators
            (``fleet.kernel.fingerprint``; raises ``ConfigurationError`` here
            when the source cannot be read, as for code built by ``exec``).
        compatible_with: recorded fingerprints this body may replay: the
            author's assertion, reviewed in the diff, that an edit is
            replay-compatible.
        step_families: extra family patterns for dynamic ids.
    """
    if not isinstance(flow_id, str) or not _ID.match(flow_id):
        raise ConfigurationError(
            f"flow id {flow_id!r} is not usable: use 1-200 letters, digits or ._:-/")
    if not isinstance(version, int) or version < 1:
        raise ConfigurationError(f"flow {flow_id!r}: version must be an int >= 1, got {version!r}")
    if deadline is not None and deadline <= 0:
        raise ConfigurationError(f"flow {flow_id!r}: deadline must be > 0 seconds")
    if len(set(steps)) != len(tuple(steps)):
        raise ConfigurationError(f"flow {flow_id!r}: declared steps repeat an id")
    if code_fingerprint is not None and (not isinstance(code_fingerprint, str)
                                         or not 0 < len(code_fingerprint) <= 200):
        raise ConfigurationError(
            f"flow {flow_id!r}: code_fingerprint must be 'auto' or a string of 1-200 "
            f"characters, got {code_fingerprint!r}")
    if isinstance(compatible_with, str) or not all(
            isinstance(c, str) and c for c in compatible_with):
        raise ConfigurationError(
            f"flow {flow_id!r}: compatible_with must be a list of recorded fingerprints, "
            f"got {compatible_with!r}")

    def wrap(body: FlowBody) -> FlowDefinition:
        if not inspect.iscoroutinefunction(body):
            raise ConfigurationError(
                f"flow {flow_id!r}: the body must be an `async def` taking (ctx, input)")
        fingerprint = (auto_fingerprint(body, flow_id) if code_fingerprint == AUTO
                       else code_fingerprint)
        return FlowDefinition(flow_id=flow_id, version=version, body=body,
                              steps=tuple(steps), deadline=deadline,
                              code_fingerprint=fingerprint,
                              compatible_with=tuple(compatible_with),
                              step_families=tuple(step_families))
    return wrap


class FlowRegistry:
    """Every registered version of every flow, newest version first."""

    def __init__(self, flows: Sequence[FlowDefinition] = ()) -> None:
        self._by_id: dict[str, list[FlowDefinition]] = {}
        for definition in flows:
            self.register(definition)

    def register(self, definition: FlowDefinition) -> None:
        if not isinstance(definition, FlowDefinition):
            raise ConfigurationError(
                f"{definition!r} is not a flow: decorate the body with @flow(...)")
        versions = self._by_id.setdefault(definition.flow_id, [])
        if any(d.version == definition.version for d in versions):
            raise ConfigurationError(
                f"flow {definition.flow_id!r} version {definition.version} is registered twice")
        versions.append(definition)
        versions.sort(key=lambda d: d.version, reverse=True)

    def latest(self, flow_id: str) -> FlowDefinition | None:
        versions = self._by_id.get(flow_id)
        return versions[0] if versions else None

    def versions(self, flow_id: str) -> list[FlowDefinition]:
        return list(self._by_id.get(flow_id, ()))

    def resolve(self, flow_id: str, recorded_hash: str | None,
                version: int | None) -> FlowDefinition | None:
        """The version whose structure the recording names (pinned by hash)."""
        for definition in self._by_id.get(flow_id, ()):
            if recorded_hash is not None and definition.matches_hash(recorded_hash):
                return definition
        for definition in self._by_id.get(flow_id, ()):
            if recorded_hash is None and definition.version == version:
                return definition
        return None

    def pinned(self, execution_id: str, flow_id: str | None, recorded_hash: str | None,
               version: int | None, recorded_code: str | None, *,
               allow_code_mismatch: bool = False,
               ) -> tuple[FlowDefinition, FlowCodeMismatchError | None]:
        """The version a log was recorded by, checked against its recorded fingerprint.

        The structural hash selects the version first (several versions of one
        flow are each pinned by hash, so an old execution finishes on its own
        code); then that version's fingerprint is compared (``accepts_code``).
        Returns the definition and, when ``allow_code_mismatch`` let a code
        mismatch through, the refusal it would have been (for a warning).

        Raises:
            FlowNotFoundError: no version of the flow id is registered at all.
            FlowCodeMismatchError: ``kind="structure"``: none has the recorded
                hash; ``kind="code"``: the selected version refuses the
                recorded fingerprint and ``allow_code_mismatch`` is off.
        """
        versions = self._by_id.get(flow_id or "", [])
        if not versions:
            known = sorted(self._by_id)
            raise FlowNotFoundError(
                f"execution {execution_id!r} runs flow {flow_id!r}, which is not registered "
                f"here; known flows: {known}")
        definition = self.resolve(flow_id or "", recorded_hash, version)
        if definition is None:
            registered = ", ".join(f"v{d.version} {_same_form(recorded_hash, d)}"
                                   for d in versions)
            raise FlowCodeMismatchError(
                f"execution {execution_id!r} runs flow {flow_id!r} (hash {recorded_hash}); no "
                f"registered version matches ({registered}). Register the version it started "
                "on, or migrate it with resume_as",
                kind="structure", recorded=recorded_hash, registered=registered)
        if definition.accepts_code(recorded_code):
            return definition, None
        mismatch = FlowCodeMismatchError(
            f"execution {execution_id!r} was recorded by code {recorded_code!r} of flow "
            f"{flow_id!r} v{definition.version}; the registered code is "
            f"{definition.code_fingerprint!r}. Register the code it started on, list "
            f"{recorded_code!r} in compatible_with if the edit is replay-compatible, or "
            "migrate it with resume_as",
            kind="code", recorded=recorded_code, registered=definition.code_fingerprint)
        if not allow_code_mismatch:
            raise mismatch
        return definition, mismatch

    def __iter__(self) -> Any:
        for versions in self._by_id.values():
            yield from versions


def _same_form(recorded: str | None, definition: FlowDefinition) -> str:
    """``definition``'s structural hash in the form ``recorded`` uses (for messages)."""
    if recorded is not None and recorded.startswith("fnv1a:"):
        return definition.legacy_hash
    return definition.sha256_hash
