"""The broker connection of a fleet app: it survives a broker restart and comes back fast.

Every fleet app (``fleet.host.celery_api.broker_app``: the dispatcher's, the
workers', Flower's, ``fleet status``'s) opens its broker connections through
``FleetAMQP``, so each is a ``FleetConnection``; ``producer_app`` (and so
``make_app``) applies the settings ``broker_conf`` returns. Decision 0014 has
the analysis, the reproduction and the measurements.

**Surviving a restart (celery 5.7).** When the broker goes away, Celery's
consumer cleans up the lost connection with ``connection.collect()`` and, since
celery 5.7.0, then ``connection.close()``. With the Redis transport, a consumer
that was waiting in BRPOP (a worker with a free slot) holding unacknowledged
messages (tasks still running) does not survive that: ``collect()`` fails to
close the default channel on the dead socket, keeps it, and drops the transport's
client; ``close()`` closes the same channel again, which tries to restore its
unacknowledged messages through a transport that no longer has a client, and the
``AttributeError`` it raises is no connection error: it escapes the consumer and
the worker stops ("Unrecoverable error: AttributeError(\"'NoneType' object has no
attribute 'hostname'\")"). ``FleetConnection.collect`` forgets the default
channel once the connection is collected, so the ``close()`` after it has nothing
left to do: what celery 5.6 and older did (they never closed a collected
connection). The channel's in-flight messages still acknowledge through its own
pool when their tasks end. Only where Celery closes after collecting
(``CLOSES_AFTER_COLLECT``).

**Reconnecting at the pace of the outage.** The consumer reconnects through
``Connection.ensure_connection`` without intervals, so kombu's defaults apply:
2 s, then 4, 6, ... up to 30 s between attempts; a 2 s outage cost about 12 s
off the broker. ``FleetConnection.ensure_connection`` takes the intervals a
caller leaves out from the transport options (``interval_start``,
``interval_step``, ``interval_max``: the keys kombu itself already reads for
the failover of ``Connection.ensure``), and ``broker_conf`` sets them from
``FleetSettings`` (0.2 s, +0.2 s, at most 1 s by default), with Redis socket
timeouts and health checks that notice a dead connection in seconds.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fleet.config import FleetSettings
from fleet.host.celery_api import AMQP, Connection, celery_version

# Celery 5.7.0 (celery/celery#10242) added ``connection.close()`` after
# ``connection.collect()`` in ``Consumer.on_connection_error_after_connected``.
CLOSES_AFTER_COLLECT: bool = celery_version() >= (5, 7)

# The positional order of kombu's ``Connection.ensure_connection`` arguments.
_POSITIONAL = ("errback", "max_retries", "interval_start", "interval_step", "interval_max")
_INTERVALS = ("interval_start", "interval_step", "interval_max")
_REDIS_SCHEMES = ("redis", "rediss", "sentinel", "valkey", "valkeys")


class FleetConnection(Connection):  # type: ignore[misc]
    """A kombu ``Connection`` whose reconnect pace and cleanup suit a fleet worker."""

    #: Forget the default channel once collected (see the module docstring).
    forget_channel_on_collect: bool = CLOSES_AFTER_COLLECT

    def ensure_connection(self, *args: Any, **kwargs: Any) -> Any:
        """kombu's ``ensure_connection``; intervals not given come from the transport options."""
        given = set(_POSITIONAL[:len(args)]) | set(kwargs)
        options = self.transport_options or {}
        for name in _INTERVALS:
            if name not in given and name in options:
                kwargs[name] = options[name]
        return super().ensure_connection(*args, **kwargs)

    def collect(self, socket_timeout: float | None = None) -> None:
        """Drop the connection's references; a ``close()`` after it does nothing."""
        try:
            super().collect(socket_timeout)
        finally:
            if self.forget_channel_on_collect:
                # collect() dropped the transport's client; closing this channel
                # again would try to restore its unacknowledged messages without
                # one (AttributeError, not a connection error: the worker stops).
                self._default_channel = None


class FleetAMQP(AMQP):  # type: ignore[misc]
    """Celery's AMQP helper whose connections are ``FleetConnection``s."""

    Connection = FleetConnection


def is_redis(url: str) -> bool:
    """Whether ``url`` names a Redis (or Valkey) broker."""
    return urlsplit(url).scheme in _REDIS_SCHEMES


def broker_conf(settings: FleetSettings) -> dict[str, Any]:
    """The Celery settings that decide how a fleet app's broker connections fail and return.

    * retries forever (or ``broker_max_retries`` times), first after
      ``broker_retry_interval_s``, then each ``broker_retry_interval_s`` longer,
      at most ``broker_retry_max_interval_s`` apart;
    * Redis: a connect gives up after ``broker_connect_timeout_s``, a command
      after ``broker_socket_timeout_s``, an idle connection is pinged before use
      after ``broker_health_check_s`` (and kombu drops a BRPOP overdue by that
      much), TCP keepalive on.
    """
    options: dict[str, Any] = {
        "interval_start": settings.broker_retry_interval_s,
        "interval_step": settings.broker_retry_interval_s,
        "interval_max": settings.broker_retry_max_interval_s,
    }
    if is_redis(settings.broker):
        options.update(
            socket_connect_timeout=settings.broker_connect_timeout_s,
            socket_timeout=settings.broker_socket_timeout_s,
            socket_keepalive=True,
            health_check_interval=settings.broker_health_check_s,
        )
    return {
        "broker_transport_options": options,
        "broker_connection_timeout": settings.broker_connect_timeout_s,
        "broker_connection_retry": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": settings.broker_max_retries,
    }


__all__ = ["CLOSES_AFTER_COLLECT", "FleetAMQP", "FleetConnection", "broker_conf", "is_redis"]
