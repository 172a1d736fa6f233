"""The one assembly: what each fleet role runs (``fleet.assembly.roles``).

Kept free of imports: the workers' modules import ``fleet.assembly.roles``
while it imports none of theirs.
"""
