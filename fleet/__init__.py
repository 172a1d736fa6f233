"""fleet: durable execution for Python."""
