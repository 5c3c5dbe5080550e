"""What ``import ds_odc`` does: no DeepSpeed for ``ds_odc.balancer``; the ``odc`` key as soon as DeepSpeed exists.

Each case runs in a fresh interpreter (the test process has imported both long ago)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOADED = "sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'torch', 'transformers'})"
HOOKED = "[type(f).__name__ for f in sys.meta_path if type(f).__module__ == 'ds_odc']"


def test_balancer_imports_no_deepspeed_and_patches_nothing():
    r = run(f"""
import json, sys
import ds_odc.balancer
from ds_odc.balancer import plan_minibatch
plan = plan_minibatch([100, 30, 2000, 7, 64], world_size=2, planner="lb-mini", max_tokens=4096)
print(json.dumps({{"loaded": {LOADED}, "patched": ds_odc._patched, "ranks": len(plan.microbatches)}}))
""")
    assert r == {"loaded": [], "patched": False, "ranks": 2}


def test_odc_key_installed_when_deepspeed_is_imported_after_ds_odc():
    r = run(f"""
import json, sys, importlib.util
import ds_odc
probe = importlib.util.find_spec("deepspeed") is not None  # a lookup, as transformers does: no import, no patch
before = {{"loaded": {LOADED}, "patched": ds_odc._patched, "hooked": {HOOKED}}}
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config
from ds_odc.config import OdcZeroConfig
ds_odc.patch(); ds_odc.patch()
print(json.dumps({{"probe": probe, "before": before, "patched": ds_odc._patched, "hooked": {HOOKED},
                  "model": DeepSpeedZeroConfig is OdcZeroConfig,
                  "odc": get_zero_config({{"zero_optimization": {{"stage": 3, "odc": True}}}}).odc.enabled}}))
""")
    assert r["probe"] and r["before"] == {"loaded": [], "patched": False, "hooked": ["_PatchAfterDeepSpeedImport"]}
    assert r["patched"] and r["model"] and r["odc"] and r["hooked"] == []


def test_odc_key_installed_at_once_when_deepspeed_came_first():
    r = run(f"""
import json, sys
import deepspeed
import ds_odc
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from ds_odc import OdcConfig, FenceTimeout
print(json.dumps({{"patched": ds_odc._patched, "hooked": {HOOKED}, "model": DeepSpeedZeroConfig.__name__,
                  "exports": [OdcConfig.__name__, FenceTimeout.__name__]}}))
""")
    assert r == {"patched": True, "hooked": [], "model": "OdcZeroConfig", "exports": ["OdcConfig", "FenceTimeout"]}


def test_odc_key_installed_when_a_ds_odc_module_imports_deepspeed_first():
    """`from ds_odc.config import OdcConfig` as the first import: DeepSpeed loads inside ds_odc.config, and the patch
    (which needs ds_odc.config whole) runs once that import has finished."""
    r = run(f"""
import json, sys
from ds_odc.config import OdcConfig
import ds_odc
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
print(json.dumps({{"patched": ds_odc._patched, "hooked": {HOOKED}, "model": DeepSpeedZeroConfig.__name__}}))
""")
    assert r == {"patched": True, "hooked": [], "model": "OdcZeroConfig"}


def test_deepspeed_init_distributed_on_cpu_builds_no_inference_op_once_ds_odc_is_imported():
    """Without ds_odc DeepSpeed asks for its shared-memory op at init_distributed on CPU (a JIT build of minutes on
    first use); with ds_odc imported it does not, and inference_all_reduce, the op's one user, still sums (over
    torch.distributed's all_reduce)."""
    from _support.launch import launch
    worker = ROOT / "tests" / "init_distributed_worker.py"
    stock = launch(worker, 1, ["--without-ds-odc"], launcher="plain", timeout=120).check().result
    assert "ShareMemCommBuilder" in stock["requested"], stock
    r = launch(worker, 2, launcher="plain", timeout=120).check().result
    assert r["requested"] == [] and r["sum"] == r["expected"] == 3.0, r
