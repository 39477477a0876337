"""CPU time of process trees, read from /proc: what a configuration of servers spent, every
process of it (API servers, engine cores, workers, a proxy or a bootstrap) counted."""

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, float]]:
    """Every live process: its parent and its CPU seconds so far (user + system)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        found[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS)
    return found


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """For each named root process, the CPU seconds of it and every live descendant."""
    processes = _processes()
    name_of = {pid: name for name, pid in roots.items()}
    spent = dict.fromkeys(roots, 0.0)
    for pid, (_, seconds) in processes.items():
        ancestor = pid
        while ancestor not in name_of and ancestor in processes:
            ancestor = processes[ancestor][0]
        if ancestor in name_of:
            spent[name_of[ancestor]] += seconds
    return spent
