"""``python -m ds_odc``: the environment report; ``python -m ds_odc check CONFIG.json``: validate a ds_config."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_odc", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("report", help="what ODC can use on this machine (the default)")
    check = commands.add_parser("check", help="validate the zero_optimization block of a ds_config JSON file, "
                                              "odc key included, and print the resolved odc settings")
    check.add_argument("config", help="ds_config JSON file")
    args = parser.parse_args(argv)
    if args.command == "check":
        from ds_odc.cli.check import main as check_main
        return check_main(args.config)
    from ds_odc.cli.report import main as report_main
    return report_main()


if __name__ == "__main__":
    sys.exit(main())
