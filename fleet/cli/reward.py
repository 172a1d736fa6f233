"""``fleet reward submit``: a signed reward onto the rewards stream, and what became of it.

A submitted reward is accepted for attachment: the attacher joins it to its decision
or dead-letters it with a reason. ``--wait SECONDS`` waits for that and says which;
the exit code is 0 when it was attached (or was already), 1 when it was dead-lettered
or not attached in time, 2 for a usage error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fleet.cli.common import (
    echo,
    execution_id_argument,
    json_option,
    success_from,
    success_options,
    the_execution_id,
    with_options,
)
from fleet.config import FleetSettings
from fleet.host.kernel import open_store_to_read
from fleet.host.loop import run_loop
from fleet.streams.reward_fate import outcome_sequences, stream_marks, wait_for_reward
from fleet.streams.rewards import submit_reward_from_settings


@click.group()
def reward() -> None:
    """Rewards for logged decisions, through the signed rewards stream."""


async def _before(settings: FleetSettings, execution_id: str, decision_id: str, key: str,
                  producer: str) -> list[int]:
    store = open_store_to_read(settings)
    try:
        return await outcome_sequences(store, execution_id, decision_id, key, producer)
    finally:
        await store.close()


@reward.command("submit")
@execution_id_argument
@click.option("--decision", "decision_id", required=True)
@click.option("--key", required=True, help="a namespaced reward key, e.g. csat:1")
@click.option("--score", type=float, default=None)
@with_options(success_options)
@click.option("--producer", required=True, help="names the producer's key")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help='a reward key file: a JSON object {"producer": "secret"}, the format '
              "`fleet up` writes to .fleet/reward-keys.json (default: FLEET_REWARD_KEYS_FILE "
              "or FLEET_REWARD_KEYS)")
@click.option("--nonce", default=None)
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=None,
              help="seconds to wait for the attacher: attached, or dead-lettered and why "
              "(needs the store: FLEET_DATABASE_URL)")
@json_option
def reward_submit(execution_id: str | None, execution_option: str | None, decision_id: str,
                  key: str, score: float | None, success: bool | None, failure: bool,
                  producer: str, key_file: Path | None, nonce: str | None,
                  wait_s: float | None, as_json: bool) -> None:
    """Sign a reward for EXECUTION_ID's decision and push it onto the rewards inbox.

    Refused before anything is sent when the keys hold none for --producer or
    the attacher would refuse the reward. Sent, it is accepted for attachment,
    not attached yet: the attacher joins it to the decision or dead-letters it
    (an unknown execution or decision, another tenant's, a refused outcome);
    --wait says which.
    """
    eid = the_execution_id(execution_id, execution_option)
    success = success_from(success, failure)
    settings = FleetSettings()
    before = None
    marks = None
    if wait_s is not None:
        before = run_loop(_before(settings, eid, decision_id, key, producer))
        marks = run_loop(stream_marks(settings))
    entry = submit_reward_from_settings(
        settings, execution_id=eid, decision_id=decision_id, key=key,
        producer=producer, score=score, success=success, key_file=key_file, nonce=nonce)
    if wait_s is None:
        if as_json:
            click.echo(json.dumps({"entry": entry, "status": "accepted"}))
        else:
            echo(f"accepted for attachment as reward {entry}: the attacher joins it to "
                 f"decision {decision_id!r} of {eid} or dead-letters it "
                 f"({settings.rewards_dead}); --wait SECONDS waits and says which")
        return
    fate = run_loop(wait_for_reward(
        settings, entry=entry, execution_id=eid, decision_id=decision_id, key=key,
        producer=producer, before=before or [], timeout_s=wait_s, marks=marks))
    if as_json:
        click.echo(json.dumps(fate.to_dict()))
    else:
        echo(fate.message(wait_s))
    if not fate.ok:
        sys.exit(1)


__all__ = ["reward"]
