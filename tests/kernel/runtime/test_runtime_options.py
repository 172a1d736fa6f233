"""``RuntimeOptions`` and ``RuntimeStats`` (issue 11, decision 0015).

DESIGN.md's keyword arguments keep working; ``options=RuntimeOptions(...)`` is
the same settings, grouped and documented; passing both is refused. Counters
live in ``runtime.stats`` and stay readable (not writable) as attributes.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from fleet import (
    AccessPolicy,
    ConfigurationError,
    Context,
    Features,
    Runtime,
    RuntimeOptions,
    RuntimeStats,
    flow,
)
from fleet.kernel import options as options_module
from fleet.kernel import runtime as runtime_module
from fleet.kernel.options import COUNTERS, parse_divergence
from fleet.kernel.store.memory import MemoryEventStore


@flow("opt-echo")
async def echo(ctx: Context, value: Any) -> Any:
    return await ctx.step("echo", lambda: value)


def test_keyword_arguments_and_options_are_the_same_settings() -> None:
    policy = AccessPolicy(rules={"read": "any"})
    by_kwargs = Runtime(MemoryEventStore(), divergence="fail", lease_ms=5_000,
                        access_policy=policy, holder="h", local_timers=False)
    by_options = Runtime(MemoryEventStore(), options=RuntimeOptions(
        divergence="fail", lease_ms=5_000, access_policy=policy, holder="h",
        local_timers=False))
    assert by_kwargs.options == by_options.options
    for runtime in (by_kwargs, by_options):
        assert (runtime.divergence, runtime.lease_ms, runtime.holder) == ("fail", 5_000, "h")
        assert runtime.access_policy is policy


def test_options_and_keyword_arguments_together_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"\['lease_ms', 'strict'\]"):
        Runtime(MemoryEventStore(), options=RuntimeOptions(), strict=True, lease_ms=500)


@pytest.mark.parametrize(("changes", "message"), [
    ({"divergence": "loud"}, "divergence must be"),
    ({"lease_ms": 99}, "lease_ms must be"),
    ({"lease_ms": True}, "lease_ms must be"),
    ({"inline_sleep_max": -1}, "inline_sleep_max must be"),
])
def test_bad_options_are_refused_with_what_was_wrong(changes: dict[str, Any],
                                                     message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RuntimeOptions(**changes)
    with pytest.raises(ConfigurationError, match=message):
        Runtime(MemoryEventStore(), **changes)


def test_the_divergence_mode_defaults_to_fail_when_strict() -> None:
    assert Runtime(MemoryEventStore(), strict=True).divergence == "fail"
    assert Runtime(MemoryEventStore()).divergence == runtime_module.DEFAULT_DIVERGENCE
    assert Runtime(MemoryEventStore(), strict=True, divergence="off").divergence == "off"
    assert RuntimeOptions(strict=True).divergence_mode("warn") == "fail"


def test_a_divergence_setting_is_parsed_or_refused() -> None:
    assert parse_divergence(None) is None
    assert parse_divergence("warn") == "warn"
    with pytest.raises(ConfigurationError, match="'off', 'warn' or 'fail'"):
        parse_divergence("WARN")


def test_every_option_is_documented() -> None:
    """All 19 settings of ``Runtime``: the 15 options in the options module's guide,
    every keyword (and ``store``/``flows``/``snapshots``/``options``) in Runtime's."""
    fields = [f.name for f in dataclasses.fields(RuntimeOptions)]
    assert len(fields) == 15
    guide = options_module.__doc__ or ""
    for name in fields:
        assert f"``{name}``" in guide, name
    parameters = list(inspect.signature(Runtime).parameters)
    assert set(parameters) == {"store", "flows", "snapshots", "options", *fields}
    doc = Runtime.__doc__ or ""
    for name in parameters:
        assert f"{name}" in doc, name


def test_options_are_frozen_and_copied_with_changes() -> None:
    base = RuntimeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.lease_ms = 1_000  # type: ignore[misc]
    changed = base.with_changes(lease_ms=1_000, features=Features(sha256_flow_hash=True))
    assert (changed.lease_ms, changed.features.sha256_flow_hash) == (1_000, True)
    with pytest.raises(ConfigurationError):
        base.with_changes(lease_ms=1)


async def test_counters_are_in_stats_and_readable_but_not_writable_as_attributes() -> None:
    runtime = Runtime(MemoryEventStore(), flows=[echo])
    assert await (await runtime.start("opt-echo", 3)).result() == 3
    await runtime.close()
    assert isinstance(runtime.stats, RuntimeStats)
    assert list(runtime.stats.as_dict()) == list(COUNTERS)
    assert len(COUNTERS) == 13
    for name in COUNTERS:
        assert getattr(runtime, name) == getattr(runtime.stats, name), name
    assert (runtime.drives, runtime.completed) == (1, 1)
    with pytest.raises(AttributeError):
        runtime.completed = 0  # type: ignore[misc]
