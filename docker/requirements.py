"""Prints kvroom's pinned requirements from pyproject.toml, one a line, for an image's dependency layer.

    python3 requirements.py cpu                 the dependencies and the `cpu` extra
    python3 requirements.py --only NAME [NAME]  only these packages, at kvroom's pins

The layer needs pyproject.toml alone, so it stays cached while the code changes, and building it
needs nothing of the code (the version, for one, lives in the code).
"""

import argparse
import itertools
import re
import tomllib
from pathlib import Path


def name(requirement: str) -> str:
    return re.split(r"[\s\[=<>!~;]", requirement, maxsplit=1)[0].lower()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("extras", nargs="*", help="extras to add to the dependencies")
    parser.add_argument("--only", nargs="+", help="print only these packages")
    args = parser.parse_args()
    project = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = list(project["dependencies"])
    for extra in args.extras:
        requirements += extras[extra]
    if args.only:
        wanted = {n.lower() for n in args.only}
        requirements = [r for r in [*requirements, *itertools.chain(*extras.values())] if name(r) in wanted]
        missing = wanted - {name(r) for r in requirements}
        if missing:
            parser.error(f"not in pyproject.toml: {', '.join(sorted(missing))}")
    print("\n".join(dict.fromkeys(requirements)))


if __name__ == "__main__":
    main()
