"""What the bootstrap, prefill and decode services share, one subpackage per job.

- ``shared.room``: a room's states, its record on a node, and the success gate (pure rules, no I/O).
- ``shared.kv``: the KV page layout, the pool, head splits, aux buffers, page digests, the transfer engine.
- ``shared.wire``: the protocol, ZMQ I/O, CURVE security, per-turn batching, the registration schema.
- ``shared.models``: the KV-source interface and its factory, the reference model, Hugging Face
  models, synthetic KV, model files.
- ``shared.node``: the node framework both roles run on: runtime, leader, rank, membership, agreement.

Top-level modules are the small things every service uses: errors, settings, metrics, logs, cli.

Layers (held by ``tests/unit/test_layers.py``), bottom to top: errors, cli, logs, heap, settings,
``kv``, ``room``, ``metrics``, ``wire``, ``models``, ``node``; each imports only those below it.
The bootstrap imports neither torch, ``shared.node``, ``shared.models`` nor a role package;
nothing under ``shared/`` imports a role package.
"""
