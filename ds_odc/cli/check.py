"""``python -m ds_odc check CONFIG.json``: validate a ds_config's ``zero_optimization`` block the way
``deepspeed.initialize`` will with ds_odc imported, and print the ``odc`` settings it resolves to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["check", "main"]


def check(ds_config: dict) -> dict:
    """The resolved ``odc`` block of ``ds_config`` (raises pydantic's ValidationError naming a bad key).

    Keys set to ``"auto"`` are left out: the Hugging Face Trainer fills them in before DeepSpeed reads them."""
    import ds_odc
    from ds_odc.config import OdcZeroConfig

    ds_odc.patch()
    zero = {k: v for k, v in ds_config.get("zero_optimization", {}).items() if v != "auto"}
    return OdcZeroConfig(**zero).odc.model_dump()


def main(path: str) -> int:
    from pydantic import ValidationError
    try:
        ds_config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"ds_odc: cannot read {path}: {err}", file=sys.stderr)
        return 2
    try:
        odc = check(ds_config)
    except ValidationError as err:
        print(f"ds_odc: {path}: zero_optimization is not valid:\n{err}", file=sys.stderr)
        return 1
    stage = ds_config.get("zero_optimization", {}).get("stage")
    if not odc["enabled"]:
        print(f"{path}: valid; ODC off (no zero_optimization.odc key, or enabled: false)")
    elif stage != 3:
        print(f"ds_odc: {path}: odc needs zero_optimization.stage 3 (found {stage!r}); deepspeed.initialize will "
              "refuse it", file=sys.stderr)
        return 1
    else:
        print(f"{path}: valid; ODC on with {json.dumps(odc)}")
    return 0
