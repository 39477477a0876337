"""python -m prefill_node [--help]"""

from prefill_node.service import PrefillService
from prefill_node.settings import PrefillSettings
from shared.cli import parse_settings
from shared.node.runtime import run_node


def main() -> None:
    run_node("prefill", parse_settings(PrefillSettings), PrefillService)


if __name__ == "__main__":
    main()
