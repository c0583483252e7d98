"""``python -m krunbox doctor``: can this host boot microVMs, and where are krunbox's parts?"""

from __future__ import annotations

import argparse
import sys

from . import ARTIFACTS, _krunbox


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krunbox")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "doctor",
        help="report whether this host can boot microVMs (exit status 1 if not)",
    )
    parser.parse_args(argv)
    report, can_boot = _krunbox.doctor(ARTIFACTS)
    print(report)
    return 0 if can_boot else 1


if __name__ == "__main__":
    sys.exit(main())
