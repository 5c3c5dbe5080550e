"""``python -m ds_odc``: the environment report; ``python -m ds_odc check CONFIG.json``: validate a ds_config.

Works from any folder, and says what is missing (and how to install it) in a Python without torch or DeepSpeed
instead of failing with a traceback."""

from __future__ import annotations

import argparse
import sys

__all__: list[str] = []

NEEDED = ("torch", "deepspeed", "pydantic")  # what every command imports (pydantic: DeepSpeed's config models)


def main(argv: list[str] | None = None) -> int:
    _use_this_package()
    parser = argparse.ArgumentParser(prog="python -m ds_odc", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("report", help="what ODC can use on this machine (the default)")
    check = commands.add_parser("check", help="read a ds_config JSON file as deepspeed.initialize will with "
                                              "ds_odc imported: every option it would refuse under ODC, and the "
                                              "resolved odc settings")
    check.add_argument("config", help="ds_config JSON file")
    args = parser.parse_args(argv)
    missing = _missing()
    if missing:
        print(_missing_message(missing), file=sys.stderr)
        return 1
    if args.command == "check":
        from ds_odc.cli.check import main as check_main
        return check_main(args.config)
    from ds_odc.cli.report import main as report_main
    return report_main()


def _missing() -> list[str]:
    import importlib.util
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def _missing_message(missing: list[str]) -> str:
    import os
    import platform
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    in_clone = os.path.isfile(os.path.join(root, "scripts", "install.sh"))
    venv = os.path.join(root, ".venv", "bin", "python")
    lines = [f"ds_odc: this Python ({sys.executable}, {platform.python_version()}) has no {', '.join(missing)}, "
             "which ds_odc needs."]
    if in_clone and os.path.isfile(venv) and os.path.realpath(sys.executable) != os.path.realpath(venv):
        lines.append(f"  ds_odc's environment is installed: run {venv} -m ds_odc (or source "
                     f"{os.path.join(root, '.venv', 'bin', 'activate')} first).")
    elif in_clone:
        lines.append(f"  Install it with: bash {os.path.join(root, 'scripts', 'install.sh')}   (creates "
                     f"{os.path.join(root, '.venv')}; then run .venv/bin/python -m ds_odc)")
    lines.append('  Or, in the environment you train in: pip install torch "deepspeed>=0.19.8,<0.20" and ds_odc '
                 "(pip install -e PATH_TO_THE_CLONE).")
    return "\n".join(lines)


def _use_this_package() -> None:
    """Run from a folder that holds a folder named ``ds_odc`` (such as the parent of a clone called ds_odc), Python
    finds that folder first and imports it as an empty namespace package, while this file comes from the installed
    package (an editable install is looked up after the current folder). Put the package this file belongs to in its
    place, so that ``import ds_odc`` below means ds_odc."""
    import importlib.util
    import os
    package = sys.modules.get("ds_odc")
    if package is not None and getattr(package, "__file__", None):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("ds_odc", os.path.join(here, "__init__.py"),
                                                  submodule_search_locations=[here])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ds_odc"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    sys.exit(main())
