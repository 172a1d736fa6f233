"""Example flows bundled with fleet (used by ``fleet run`` and the docs)."""
