"""The node framework both roles run on.

Reading path: ``runtime`` (processes, signals, HTTP, drain), ``leader`` (rank 0: registration,
reports, the links to other ranks), ``rank`` (one rank: its sockets, pool and engine, and the
role service's messages), ``agreement`` (ranks agree on each room's outcome), ``membership``
(joining the bootstrap, heartbeats, leaving).
"""
