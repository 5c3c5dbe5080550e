"""``python -m ds_odc check CONFIG.json``: read a ds_config the way ``deepspeed.initialize`` will with ds_odc imported,
report every option it would refuse under ODC, and print the ``odc`` settings it resolves to.

The refusals are ODC's own rules (:mod:`ds_odc.zero.validate`), the ones ``deepspeed.initialize`` runs; only those
that depend on the job rather than the file (``CHECKED_AT_INITIALIZE``) are left to it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__: list[str] = []


@dataclass
class Checked:
    odc: dict
    """The resolved ``zero_optimization.odc`` block."""
    problems: list[str] = field(default_factory=list)
    """What ``deepspeed.initialize`` would refuse, one message each (empty when ODC is off)."""
    warnings: list[str] = field(default_factory=list)
    """Options ODC accepts and ignores."""


def check(ds_config: dict) -> Checked:
    """What ``deepspeed.initialize`` makes of ``ds_config`` under ODC (raises pydantic's ValidationError naming a bad
    key, or DeepSpeed's own error for a config it cannot read).

    Keys set to ``"auto"`` are skipped, as DeepSpeed's config models skip them: the Hugging Face Trainer fills them
    in before DeepSpeed reads them."""
    import ds_odc
    from ds_odc.zero.engine import odc_requested
    from ds_odc.zero.validate import config_problems, config_warnings, read_config

    ds_odc.patch()
    config = read_config(ds_config)
    resolved = config.zero_config.odc.model_dump()
    if not odc_requested(ds_config):
        return Checked(resolved)
    return Checked(resolved, [str(e) for e in config_problems(config)], config_warnings(config))


def main(path: str) -> int:
    import ds_odc
    ds_odc.patch()  # imports DeepSpeed with its stdout line sent to stderr
    from deepspeed.runtime.config import DeepSpeedConfigError
    try:
        ds_config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"ds_odc: cannot read {path}: {err}", file=sys.stderr)
        return 2
    try:
        checked = check(ds_config)
    except (ValueError, AssertionError, DeepSpeedConfigError) as err:  # pydantic's ValidationError is a ValueError
        print(f"ds_odc: {path} is not a valid ds_config:\n{err}", file=sys.stderr)
        return 1
    for warning in checked.warnings:
        print(warning, file=sys.stderr)
    if checked.problems:
        print(f"ds_odc: {path}: deepspeed.initialize will refuse this config under ODC "
              f"({len(checked.problems)} problem{'s' if len(checked.problems) > 1 else ''}):", file=sys.stderr)
        for problem in checked.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    if not checked.odc["enabled"]:
        print(f"{path}: valid; ODC off (no zero_optimization.odc key, or enabled: false)")
    else:
        from ds_odc.zero.validate import CHECKED_AT_INITIALIZE
        print(f"{path}: valid; ODC on with {json.dumps(checked.odc)}\n"
              f"  (left to deepspeed.initialize, as they depend on the job: {CHECKED_AT_INITIALIZE})")
    return 0
