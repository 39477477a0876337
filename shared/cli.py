"""Command-line entry points: settings from flags and environment, errors in one line each."""

import sys
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from shared.errors import KvroomError

VERSION = "0.3.0"
S = TypeVar("S", bound=BaseSettings)


def parse_settings(cls: type[S], argv: list[str] | None = None) -> S:
    """``cls`` from the environment and ``argv``; exit 2 with one line per bad setting, 0 after --version."""
    args = sys.argv[1:] if argv is None else argv
    prog = cls.model_config.get("cli_prog_name") or "kvroom"
    if "--version" in args:
        print(f"{prog} {VERSION}")
        raise SystemExit(0)
    try:
        return cls(_cli_parse_args=args)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            field = ".".join(str(part) for part in error["loc"]) or "settings"
            flag = f"--{field.replace('_', '-')}" if error["loc"] else field
            print(f"{prog}: {flag}: {error['msg']}", file=sys.stderr)
    except (SettingsError, KvroomError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
    raise SystemExit(2)
