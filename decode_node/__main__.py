"""python -m decode_node [--help]"""

from decode_node.service import DecodeService
from decode_node.settings import DecodeSettings
from shared.cli import parse_settings
from shared.node.runtime import run_node


def main() -> None:
    run_node("decode", parse_settings(DecodeSettings), DecodeService)


if __name__ == "__main__":
    main()
