"""``fleet reward submit``: a signed reward onto the rewards stream."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fleet.cli.common import (
    json_option,
    success_from,
    success_options,
    with_options,
)
from fleet.config import FleetSettings
from fleet.streams.rewards import submit_reward_from_settings


@click.group()
def reward() -> None:
    """Rewards for logged decisions, through the signed rewards stream."""


@reward.command("submit")
@click.option("--execution", "execution_id", required=True)
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
@json_option
def reward_submit(execution_id: str, decision_id: str, key: str, score: float | None,
                  success: bool | None, failure: bool, producer: str, key_file: Path | None,
                  nonce: str | None, as_json: bool) -> None:
    """Sign a reward with the producer's key and send it to the rewards inbox.

    Refused before anything is sent when the keys hold none for --producer or
    the attacher would refuse the reward.
    """
    success = success_from(success, failure)
    entry = submit_reward_from_settings(
        FleetSettings(), execution_id=execution_id, decision_id=decision_id, key=key,
        producer=producer, score=score, success=success, key_file=key_file, nonce=nonce)
    click.echo(json.dumps({"entry": entry}) if as_json else f"submitted as {entry}")


__all__ = ["reward"]
