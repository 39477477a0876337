"""python -m decode_node [--help]"""

from decode_node.role import DECODE
from shared.cli import parse_settings
from shared.node.runtime import run_node


def main() -> None:
    run_node(DECODE, parse_settings(DECODE.settings))


if __name__ == "__main__":
    main()
