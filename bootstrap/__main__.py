"""python -m bootstrap [--help]  |  python -m bootstrap keys --out DIR NAME [NAME ...]"""

import argparse
import sys
from pathlib import Path

import uvicorn

from bootstrap.app import create_app
from bootstrap.settings import BootstrapSettings
from shared.cli import parse_settings
from shared.logs import configure_logging
from shared.wire.security import write_keys


def keys(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bootstrap keys",
        description="Write CURVE key pairs: NAME.key (public, share it) and NAME.key_secret (keep it).",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    parser.add_argument(
        "names", nargs="+", metavar="NAME", help="one key pair per name (bootstrap, prefill-0, ...)"
    )
    args = parser.parse_args(argv)
    for name in args.names:
        public, secret = write_keys(args.out, name)
        print(f"{name}: {public} {secret}")
    return 0


def main() -> None:
    if sys.argv[1:2] == ["keys"]:
        raise SystemExit(keys(sys.argv[2:]))
    settings = parse_settings(BootstrapSettings)
    configure_logging(settings.log_level, settings.log_format, "bootstrap")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.http_port, log_config=None)


if __name__ == "__main__":
    main()
