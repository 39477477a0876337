"""python -m prefill_node [--help]"""

import uvloop

from prefill_node.service import PrefillService
from prefill_node.settings import PrefillSettings
from shared.logs import configure_logging
from shared.model import configure_determinism


def main() -> None:
    settings = PrefillSettings(_cli_parse_args=True)  # type: ignore[call-arg]
    configure_logging(settings.log_level, settings.log_format, "prefill")
    configure_determinism()
    uvloop.run(PrefillService(settings).run())


if __name__ == "__main__":
    main()
