"""``RuntimeOptions``: how a ``Runtime`` behaves; ``RuntimeStats``: what it counted.

``Runtime(store, flows=..., options=RuntimeOptions(...))`` and the keyword
arguments DESIGN.md lists (``Runtime(store, divergence="fail", lease_ms=...)``)
are two spellings of the same settings: the keywords build a ``RuntimeOptions``.

The options, by group (every one has a default):

**Who may do what**

- ``access_policy`` (``AccessPolicy()``): the rule per op; ``owner`` for every op
  (``start`` aside) except ``read``, which is ``tenant``.
- ``strict`` (False): every op needs a principal (a call with ``principal=None``
  is refused), and ``"fail"`` is the divergence default.

**Replay and code** (ADR 0113)

- ``divergence`` (None): what a re-run that skipped recorded steps does before new
  work: ``"off"`` (not judged), ``"warn"`` (warned once, proceeds), ``"fail"``
  (refused and parked on the reserved gate). None: ``"fail"`` when ``strict``,
  otherwise the shipped default (``fleet.kernel.runtime.DEFAULT_DIVERGENCE``).
- ``features`` (``Features()``): fleet-wide switches for what new executions
  record (``sha256_flow_hash``).
- ``allow_flow_code_mismatch`` (False): drive an execution whose recorded code
  fingerprint the registered version does not accept (warned): an operator's
  override, never a default.

**Leases** (decision 0004)

- ``holder`` (None): this runtime's name on the fences it holds; None makes
  ``host:pid:random``.
- ``lease_ms`` (30,000): how long a fence is held without renewal; a run renews
  every third of it. At least 100.

**Timers and time**

- ``inline_sleep_max`` (1.0): a ``ctx.sleep`` up to this many seconds waits in the
  run; a longer one parks the execution until its timer fires.
- ``local_timers`` (True): fire a parked execution's timer from this process
  (a loop timer); the fleet turns it off and runs the timer service instead.
- ``clock`` (None): milliseconds since the epoch; None is the wall clock. Tests
  pass a manual clock (give the same one to the store).

**Queues** (decision 0056)

- ``queues`` (()): the ``Queue`` declarations ``start(..., queue=)`` may name; a
  fleet declares the same in every process (``FLEET_QUEUES``).

**Observers** (ADR 0147)

- ``on_event``: every event as the run folds it, before its write: immediate,
  and able to report an event that NEVER BECAME DURABLE (a write that later
  fails, is refused because another holder took the execution, or dies with
  its process; the lost sequence is reused, so nothing on the event shows
  it). A surface built on it can show a phantom. Use ``on_durable_event``
  for anything that acts on an event. Events written outside a run (resume,
  send, cancel, a fired timer, a late outcome, a reopen, a denial audit)
  reach it only once stored.
- ``on_durable_event``: every event this runtime wrote, once the store has it;
  never a lost, rejected or fenced write.
- ``on_warn``: a warning (a broken observer, a refused write, a divergence):
  a string; None logs to the ``fleet`` logger.
- ``on_execution_denied``: every refused op, with the full caller detail
  (``{"executionId", "op", "actor", "tenant", "reason"}``).

A consumer that throws never reaches a run; it is warned at most once a minute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.flows import Features
from fleet.kernel.observers import EventObserver, WarnSink
from fleet.kernel.queues import Queue
from fleet.kernel.security import AccessPolicy

DivergenceMode = Literal["off", "warn", "fail"]
DIVERGENCE_MODES: tuple[DivergenceMode, ...] = ("off", "warn", "fail")
Clock = Callable[[], int]
DeniedObserver = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """How a ``Runtime`` behaves (see the module for every option and its default)."""

    # -- who may do what
    access_policy: AccessPolicy = AccessPolicy()
    strict: bool = False
    # -- replay and code
    divergence: DivergenceMode | None = None
    features: Features = Features()
    allow_flow_code_mismatch: bool = False
    # -- leases
    holder: str | None = None
    lease_ms: int = 30_000
    # -- timers and time
    inline_sleep_max: float = 1.0
    local_timers: bool = True
    clock: Clock | None = None
    # -- queues
    queues: Sequence[Queue] = ()
    # -- observers
    on_event: EventObserver | None = None
    on_durable_event: EventObserver | None = None
    on_warn: WarnSink | None = None
    on_execution_denied: DeniedObserver | None = None

    def __post_init__(self) -> None:
        if self.divergence is not None and self.divergence not in DIVERGENCE_MODES:
            raise ConfigurationError(
                f"divergence must be 'off', 'warn' or 'fail', got {self.divergence!r}")
        if isinstance(self.lease_ms, bool) or not isinstance(self.lease_ms, int) \
                or self.lease_ms < 100:
            raise ConfigurationError(f"lease_ms must be an int of at least 100 (ms), got "
                                     f"{self.lease_ms!r}")
        if not isinstance(self.inline_sleep_max, (int, float)) or self.inline_sleep_max < 0:
            raise ConfigurationError(
                f"inline_sleep_max must be a number of seconds >= 0, got "
                f"{self.inline_sleep_max!r}")

    def divergence_mode(self, default: DivergenceMode) -> DivergenceMode:
        """The mode in force: the one set, else ``"fail"`` when strict, else ``default``."""
        return self.divergence or ("fail" if self.strict else default)

    def with_changes(self, **changes: Any) -> RuntimeOptions:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)


def parse_divergence(value: str | None) -> DivergenceMode | None:
    """A divergence mode read from a setting (None: the default), or ConfigurationError."""
    if value is None:
        return None
    for mode in DIVERGENCE_MODES:
        if value == mode:
            return mode
    raise ConfigurationError(f"divergence must be 'off', 'warn' or 'fail', got {value!r}")


@dataclass(slots=True)
class RuntimeStats:
    """What a runtime counted since it was built (the fleet exports these to Flower).

    ``Runtime`` also offers each as a read-only attribute (``runtime.completed``).
    """

    drives: int = 0               # runs started
    completed: int = 0            # runs that wrote EXECUTION_COMPLETED
    failed: int = 0               # runs that wrote EXECUTION_FAILED
    parked: int = 0               # runs that parked on a gate, timer, message or in-doubt step
    aborted: int = 0              # runs stopped without an end (fenced out, failed write, fault)
    recovered: int = 0            # drives that found a log ending mid-run (wrote RECOVERED)
    denied: int = 0               # ops refused by the access policy
    timers_fired: int = 0         # TIMER_FIRED written by this runtime outside a run
    divergence_warnings: int = 0  # re-runs warned as divergent (divergence="warn")
    divergence_parked: int = 0    # re-runs refused as divergent (divergence="fail")
    handed_back: int = 0          # runs let go by hand_back / hand_back_now
    refused: int = 0              # runs failed by a refusal that can never succeed (0023)
    cancelled: int = 0            # runs that wrote EXECUTION_CANCELLED (the flow let its
                                  # cancellation out: decision 0033)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


COUNTERS: tuple[str, ...] = tuple(RuntimeStats().as_dict())
