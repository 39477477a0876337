"""python -m decode_node [--help]"""

import uvloop

from decode_node.service import DecodeService
from decode_node.settings import DecodeSettings
from shared.logs import configure_logging
from shared.model import configure_determinism


def main() -> None:
    settings = DecodeSettings(_cli_parse_args=True)  # type: ignore[call-arg]
    configure_logging(settings.log_level, settings.log_format, "decode")
    configure_determinism()
    uvloop.run(DecodeService(settings).run())


if __name__ == "__main__":
    main()
