"""One typed settings object, read from ``FLEET_*`` environment variables.

Read when a program starts (``FleetSettings()``), never at import time.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class FleetSettings(BaseSettings):
    """Where fleet keeps its state and how it runs."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore")

    database_url: str = Field("sqlite:///fleet.db",
                              description="memory:, sqlite:///path or postgresql://...")
    redis_url: str | None = Field(None, description="redis://host:port/db for the fleet")
    lease_ms: int = Field(30_000, ge=100, description="how long a driver's lease lasts")
    strict: bool = Field(False, description="every call needs a principal")
    divergence: str | None = Field(None, pattern="^(off|warn|fail)$")
    sha256_flow_hash: bool = False
