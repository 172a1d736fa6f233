"""Key rings: the one format for every HMAC key the fleet checks (decision 0018).

A key ring is a JSON object keyed by **key id**; each entry names the client
that holds the key, the secret, and the tenants the client may speak for::

    {
      "web-2026-11": {"client": "web", "secret": "…", "tenants": ["acme", "globex"]},
      "web-2026-12": {"client": "web", "secret": "…", "tenants": ["acme", "globex"]},
      "ops-1":       {"client": "ops", "secret": "…", "tenants": ["*"]}
    }

* **Rotation**: a client may hold several valid keys at once (one id each):
  add the new key, move the client to it, remove the old one. A message names
  the key it was signed with (``kid``), so both verify during the switch.
* **Fail closed**: a ring file that cannot be read (gone, garbled) holds no key:
  nothing it would have verified is accepted until it is fixed (``KeySource``).
* **Scope**: ``tenants`` lists the tenants the client may act for; ``"*"`` is
  every tenant and also a principal with no tenant (an operator's key). A
  client without ``"*"`` may not act for a tenantless principal.
* **Shorthand**: ``{"id": "secret"}`` is ``{"id": {"client": "id", "secret":
  "secret", "tenants": ["*"]}}`` (``KeyEntry.bare``), for rings whose every key is an
  operator's. It is the reward key-file format, so a dispatch ring refuses it: a
  producer's reward key read as a dispatch key would speak for every tenant and for
  no principal at all (issue 25 item 11; ``DispatchVerifier``).
* ``"*"`` is never an id or a client (nor a reward producer's name): it reads as
  "every" wherever tenants are listed.

Reward producers' keys are not a ring (decision 0025): ``FLEET_REWARD_KEYS``,
``FLEET_REWARD_KEYS_FILE`` and the file ``fleet up`` writes are all one JSON
object of producer -> secret, read by ``parse_reward_keys`` /
``read_reward_keys`` wherever they are read; which tenants a producer may
reward is the attacher's setting ``FLEET_REWARD_TENANTS``, not part of a key.

Secrets are UTF-8 text of at least ``MIN_SECRET_BYTES`` bytes. A ring comes
from a setting's JSON (``FLEET_DISPATCH_KEYS``) or a file
(``FLEET_DISPATCH_KEYS_FILE``, e.g. a mounted Kubernetes Secret); a file is
read again when it changes, so a rotation needs no restart.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.kernel.errors import ConfigurationError

if TYPE_CHECKING:
    from fleet.config import FleetSettings

log = logging.getLogger("fleet.keys")

__all__ = ["ANY_TENANT", "MIN_SECRET_BYTES", "REWARD_KEYS_EXAMPLE", "KeyEntry", "KeyRing",
           "KeySource", "RewardKeyError", "parse_reward_keys", "read_reward_keys", "reward_keys_of"]

ANY_TENANT = "*"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One key: its id, the client holding it, its secret, the tenants it speaks for."""

    key_id: str
    client: str
    secret: bytes
    tenants: frozenset[str]
    bare: bool = False  # written as the shorthand ``{"id": "secret"}``

    def speaks_for(self, tenant: str | None) -> bool:
        """Whether this key may act for a principal of ``tenant`` (None: no tenant)."""
        if ANY_TENANT in self.tenants:
            return True
        return tenant is not None and tenant in self.tenants


class KeyRing:
    """Key ids -> ``KeyEntry``; build with ``parse`` (checks every entry)."""

    def __init__(self, entries: Mapping[str, KeyEntry]) -> None:
        self._entries = dict(entries)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key_id: str) -> KeyEntry | None:
        return self._entries.get(key_id)

    def ids(self) -> list[str]:
        return sorted(self._entries)

    @classmethod
    def parse(cls, data: Any, *, where: str = "the key ring",
              min_secret_bytes: int = MIN_SECRET_BYTES) -> KeyRing:
        """A ring from decoded JSON; ``ConfigurationError`` saying what is wrong where."""
        if not isinstance(data, Mapping):
            raise ConfigurationError(
                f"{where} must be a JSON object of key id -> {{\"client\", \"secret\", "
                f"\"tenants\"}}, got {type(data).__name__}; example: "
                '{"web-1": {"client": "web", "secret": "<32 random bytes, hex>", '
                '"tenants": ["acme"]}}')
        entries: dict[str, KeyEntry] = {}
        for key_id, raw in data.items():
            entries[key_id] = _entry(key_id, raw, where, min_secret_bytes)
        return cls(entries)

    @classmethod
    def loads(cls, text: str, *, where: str = "the key ring") -> KeyRing:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigurationError(f"{where} is not JSON: {str(exc)[:200]}") from exc
        return cls.parse(data, where=where)


def _entry(key_id: Any, raw: Any, where: str, min_secret_bytes: int) -> KeyEntry:
    if not isinstance(key_id, str) or not key_id or len(key_id) > 200:
        raise ConfigurationError(f"{where}: key id {key_id!r} must be 1-200 characters")
    if key_id == ANY_TENANT:
        raise ConfigurationError(f"{where}: {ANY_TENANT!r} is not a key id (it means every "
                                 "tenant where tenants are listed); name the key")
    bare = isinstance(raw, str)
    if bare:  # the shorthand: {"id": "secret"}
        raw = {"client": key_id, "secret": raw, "tenants": [ANY_TENANT]}
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"{where}: key {key_id!r} must be an object with client, "
                                 "secret and tenants (or a secret string)")
    unknown = set(raw) - {"client", "secret", "tenants"}
    if unknown:
        raise ConfigurationError(f"{where}: key {key_id!r} has unknown fields "
                                 f"{sorted(unknown)}; it takes client, secret, tenants")
    client, secret, tenants = raw.get("client"), raw.get("secret"), raw.get("tenants")
    if not isinstance(client, str) or not client or client == ANY_TENANT:
        raise ConfigurationError(f"{where}: key {key_id!r} names no client ({ANY_TENANT!r} "
                                 "is none)")
    if not isinstance(secret, str) or len(secret.encode()) < min_secret_bytes:
        raise ConfigurationError(
            f"{where}: key {key_id!r} needs a secret of at least {min_secret_bytes} bytes "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    if (not isinstance(tenants, list) or not tenants
            or not all(isinstance(t, str) and t for t in tenants)):
        raise ConfigurationError(
            f"{where}: key {key_id!r} needs \"tenants\": a non-empty list of tenant names, "
            f"or [\"{ANY_TENANT}\"] for every tenant")
    return KeyEntry(key_id, client, secret.encode(), frozenset(tenants), bare)


class KeySource:
    """The current ring from a JSON value or a file, the file re-read when it changes.

    **Fail closed** (issue 25 item 4): a file that cannot be read as a ring (gone,
    unreadable, not JSON, a bad entry) is *no* ring, never the last good one: a key
    that was revoked by removing it, or by a file that no longer says what it holds,
    must stop verifying at once. ``ring()`` is then None (every verifier refuses
    what it would have checked), ``problem`` says why (the health check and the
    Fleet page show it), and the error is logged once per distinct problem. The
    file is read again when it changes; a good file restores the ring.

    Args:
        data: The decoded JSON of a setting (``FLEET_DISPATCH_KEYS``); or None.
            A bad value is a ``ConfigurationError`` here: it cannot change while
            the process runs.
        path: A file holding the same JSON (``FLEET_DISPATCH_KEYS_FILE``); or None.
        setting: The setting's name, for messages.
    """

    def __init__(self, data: Any = None, path: str | os.PathLike[str] | None = None, *,
                 setting: str = "FLEET_DISPATCH_KEYS", check_every_s: float = 1.0) -> None:
        if data and path:
            raise ConfigurationError(f"give {setting} or {setting}_FILE, not both")
        self.setting = setting
        self.path = Path(path) if path else None
        self._check_every = check_every_s
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._ring: KeyRing | None = None
        #: Why there is no ring now (None: there is one).
        self.problem: str | None = None
        if self.path is not None:
            self._load()
        else:
            self._ring = KeyRing.parse(data or {}, where=setting)

    def _load(self) -> None:
        assert self.path is not None
        try:
            stat = self.path.stat()
            self._stamp = (stat.st_mtime_ns, stat.st_size)
            text = self.path.read_text()
            ring = KeyRing.loads(text, where=f"{self.setting}_FILE ({self.path})")
        except (OSError, UnicodeDecodeError, ConfigurationError) as exc:
            if isinstance(exc, FileNotFoundError):
                self._stamp = None
            if isinstance(exc, ConfigurationError):
                why = exc.message
            elif isinstance(exc, OSError):
                why = f"{self.setting}_FILE: cannot read {self.path}: {exc.strerror or exc}"
            else:
                why = f"{self.setting}_FILE: {self.path} is not UTF-8 text"
            problem = f"{why}; no key is accepted until it is fixed"
            if problem != self.problem:
                log.error("%s", problem)
            self._ring, self.problem = None, problem
            return
        if self.problem is not None:
            log.warning("%s_FILE (%s) is readable again: %d key(s)", self.setting, self.path,
                        len(ring))
        self._ring, self.problem = ring, None

    def ring(self) -> KeyRing | None:
        """The ring now: a changed file is read again; a file that cannot be read as a
        ring is None (fail closed: see the class docstring)."""
        if self.path is None:
            return self._ring
        now = time.monotonic()
        if now - self._checked < self._check_every:
            return self._ring
        with self._lock:
            self._checked = now
            try:
                stat = self.path.stat()
                stamp: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
            except OSError:
                stamp = None
            if stamp is None or stamp != self._stamp or self._ring is None:
                self._load()
        return self._ring

    def check(self) -> str | None:
        """Why no key is accepted now (None: the ring is readable); reads a changed file."""
        self.ring()
        return self.problem

    @classmethod
    def of(cls, data: Any, path: str | None, *, setting: str) -> KeySource | None:
        """The source a pair of settings names (``<SETTING>`` and ``<SETTING>_FILE``), or
        None when neither is set."""
        if not data and not path:
            return None
        return cls(data, path, setting=setting)


# -- reward producers' keys: one format everywhere (issue 15 item 5) ------------------

REWARD_KEYS_EXAMPLE = '{"crm": "<secret>", "survey": "<another secret>"}'


class RewardKeyError(ConfigurationError):
    """The reward keys at hand hold none for the producer named: nothing was sent."""

    code = "reward_key"


def parse_reward_keys(data: Any, *, where: str) -> dict[str, str]:
    """``{producer: secret}`` from decoded JSON; ``ConfigurationError`` saying what is wrong.

    ``where`` names the source in the message (a setting or a file).
    """
    if not isinstance(data, Mapping):
        raise ConfigurationError(
            f"{where} must be a JSON object of producer -> secret, got "
            f"{type(data).__name__}; example: {REWARD_KEYS_EXAMPLE}")
    keys: dict[str, str] = {}
    for producer, secret in data.items():
        if not isinstance(producer, str) or not producer or len(producer) > 200:
            raise ConfigurationError(f"{where}: producer name {str(producer)[:80]!r} must be "
                                     "1-200 characters")
        if producer == ANY_TENANT:
            raise ConfigurationError(f"{where}: {ANY_TENANT!r} is not a producer name (in "
                                     "FLEET_REWARD_TENANTS it means every tenant); name the "
                                     "producer")
        if not isinstance(secret, str) or not secret:
            raise ConfigurationError(
                f"{where}: the secret of producer {producer!r} must be a non-empty string "
                f"(got {type(secret).__name__}); example: {REWARD_KEYS_EXAMPLE}")
        keys[producer] = secret
    return keys


def read_reward_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``{producer: secret}`` JSON object in the file at ``path`` (what ``fleet up``
    writes to ``.fleet/reward-keys.json``); ``ConfigurationError`` naming the file."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigurationError(f"cannot read the reward key file {where}: {reason}") from exc
    if not text.strip():
        raise ConfigurationError(f"the reward key file {where} is empty; it holds a JSON "
                                 f"object of producer -> secret, e.g. {REWARD_KEYS_EXAMPLE}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        hint = ("; it looks like a bare secret: write it as {\"<producer>\": \"<secret>\"}"
                if len(text.split()) == 1 and not text.lstrip().startswith(("{", "[")) else "")
        raise ConfigurationError(
            f"the reward key file {where} is not JSON{hint}; it holds a JSON object of "
            f"producer -> secret, e.g. {REWARD_KEYS_EXAMPLE}") from exc
    return parse_reward_keys(data, where=f"the reward key file {where}")


def reward_keys_of(settings: FleetSettings) -> dict[str, str]:
    """The producers' keys a process uses: ``FLEET_REWARD_KEYS_FILE`` or ``FLEET_REWARD_KEYS``."""
    if settings.reward_keys_file and settings.reward_keys:
        raise ConfigurationError("give FLEET_REWARD_KEYS or FLEET_REWARD_KEYS_FILE, not both")
    if settings.reward_keys_file:
        return read_reward_keys(settings.reward_keys_file)
    return parse_reward_keys(settings.reward_keys, where="FLEET_REWARD_KEYS")
