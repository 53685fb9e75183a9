"""``python -m agents``: run a node agent (what ``ckpt agent`` and the embedded default start)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import Settings, SettingsError
from .daemon import run_agent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agents")
    p.add_argument("--settings-json", required=True)
    p.add_argument("--embedded", action="store_true")
    p.add_argument("--idle-exit", type=float, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = Settings.load(json.loads(a.settings_json), env={})
    except SettingsError as e:
        print(f"ckpt agent: {e}", file=sys.stderr)
        return 2
    return run_agent(settings, embedded=a.embedded, idle_exit=a.idle_exit)


if __name__ == "__main__":
    sys.exit(main())
