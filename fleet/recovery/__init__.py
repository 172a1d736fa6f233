"""The recovery sweeper: running executions nobody holds -> a drive
(``fleet.recovery.sweeper``)."""

from fleet.recovery.sweeper import RecoverySweeper

__all__ = ["RecoverySweeper"]
