"""The documentation's generated blocks: every setting, from the settings classes (docs/settings.md);
the benchmark's tables, from its latest run (docs/performance.md). ``python -m launcher.readme``
rewrites them; the tests check they are current.

A block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``.
"""

import re
import sys
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Each block, and the page it lives in.
PAGES = {"settings": DOCS / "settings.md", "benchmark": DOCS / "performance.md"}
BENCH_REPORT = ROOT / "bench" / "results" / "results.md"


def _default(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{value}`"


def settings_table(cls: type[BaseSettings]) -> str:
    prefix = cls.model_config["env_prefix"]
    prog = cls.model_config["cli_prog_name"]
    rows = [
        f"`{prog}` (environment prefix `{prefix}`):",
        "",
        "| flag | environment variable | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in cls.model_fields.items():
        secret = "secret" in str(field.annotation).lower()
        default = "—" if secret and field.default is None else _default(field.default)
        flag, env = f"`--{name.replace('_', '-')}`", f"`{prefix}{name.upper()}`"
        rows.append(f"| {flag} | {env} | {default} | {field.description or ''} |")
    return "\n".join(rows)


def settings_block() -> str:
    from bootstrap.settings import BootstrapSettings
    from decode_node.settings import DecodeSettings
    from prefill_node.settings import PrefillSettings

    return "\n\n".join(settings_table(cls) for cls in (BootstrapSettings, PrefillSettings, DecodeSettings))


def blocks() -> dict[str, str]:
    found = {"settings": settings_block()}
    if BENCH_REPORT.exists():
        found["benchmark"] = BENCH_REPORT.read_text().strip()
    return found


def render(text: str, generated: dict[str, str]) -> str:
    """``text`` with every block it holds of ``generated`` rewritten."""
    for name, body in generated.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)  # noqa: B023
    return text


def main() -> int:
    generated = blocks()
    for name, page in PAGES.items():
        if name not in generated:
            continue
        text = page.read_text()
        if f"<!-- {name}:start -->" not in text:
            raise ValueError(f"{page.name} has no {name} block")
        new = render(text, {name: generated[name]})
        if new != text:
            page.write_text(new)
            print(f"{page.relative_to(ROOT)}: generated block {name} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
