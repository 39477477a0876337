"""python -m bootstrap [--help]"""

import uvicorn

from bootstrap.app import create_app
from bootstrap.settings import BootstrapSettings
from shared.logs import configure_logging


def main() -> None:
    settings = BootstrapSettings(_cli_parse_args=True)  # type: ignore[call-arg]
    configure_logging(settings.log_level, settings.log_format, "bootstrap")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.http_port, log_config=None)


if __name__ == "__main__":
    main()
