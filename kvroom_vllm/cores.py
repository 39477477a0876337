"""The cores a connector's threads run on: not those of vLLM's forward.

vLLM's CPU workers bind their OpenMP threads, the worker's main thread among them, to the cores
``VLLM_CPU_OMP_THREADS_BIND`` names, and a thread inherits the affinity of the thread that
started it. Threads started from vLLM's calls (the rank's event loop, the transfer engine's,
ZMQ's) would then wait behind the forward on its core: a write held for a whole forward pass. So
they start with every core the host lets the process use, and the calling thread's binding is put
back as it was.
"""

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside may run on any core this process is allowed (a cgroup's cpuset
    still applies: the kernel keeps the mask within it)."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
