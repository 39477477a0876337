"""python -m prefill_node [--help]"""

from prefill_node.role import PREFILL
from shared.cli import parse_settings
from shared.node.runtime import run_node


def main() -> None:
    run_node(PREFILL, parse_settings(PREFILL.settings))


if __name__ == "__main__":
    main()
