"""Flows: ``@flow`` makes a ``FlowDefinition``; the structural flow hash.

The structural hash covers the flow id, version, deadline and declared steps
(ADR 0113 D1). New starts record the legacy ``fnv1a:`` form unless
``Features(sha256_flow_hash=True)``; both forms are always read.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import ConfigurationError

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

    def canonical(self) -> str:
        """The canonical structure both hashes are computed over."""
        return json.dumps({"id": self.flow_id, "version": self.version,
                           "deadline": self.deadline, "steps": list(self.steps)},
                          separators=(",", ":"), sort_keys=True)

    def content_hash(self, features: Features = Features()) -> str:
        return self.sha256_hash if features.sha256_flow_hash else self.legacy_hash

    @property
    def sha256_hash(self) -> str:
        h = self._hashes.get("sha256")
        if h is None:
            h = "sha256:" + hashlib.sha256(self.canonical().encode()).hexdigest()
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

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return await self.body(*args, **kwargs)


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32 bits: the legacy flow hash, still read for old logs."""
    h = 0x811C9DC5
    for byte in data:
        h ^= byte
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


def flow_content_hash(definition: FlowDefinition, features: Features = Features()) -> str:
    return definition.content_hash(features)


def flow_hash_matches(recorded: str | None, definition: FlowDefinition) -> bool:
    if recorded is None:
        return True
    if recorded.startswith("sha256:"):
        return recorded == definition.sha256_hash
    if recorded.startswith("fnv1a:"):
        return recorded == definition.legacy_hash
    return False


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
        code_fingerprint: an opt-in hash of the body, recorded as ``codeHash``.
        compatible_with: recorded fingerprints this body may replay.
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

    def wrap(body: FlowBody) -> FlowDefinition:
        if not inspect.iscoroutinefunction(body):
            raise ConfigurationError(
                f"flow {flow_id!r}: the body must be an `async def` taking (ctx, input)")
        return FlowDefinition(flow_id=flow_id, version=version, body=body,
                              steps=tuple(steps), deadline=deadline,
                              code_fingerprint=code_fingerprint,
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

    def __iter__(self) -> Any:
        for versions in self._by_id.values():
            yield from versions
