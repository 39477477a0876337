"""What crosses a socket.

Reading path: ``protocol`` (every message, its validation and the version changelog),
``zmq_io`` (framing and the sockets), ``security`` (CURVE keys and trust), ``per_turn``
(batching sends within one event-loop turn), ``registration`` (how a node describes itself to
the bootstrap: model identity, ranks, heartbeats).
"""
