"""The switches ``ds_odc.zero._deepspeed_privates`` flips in DeepSpeed, in one process (no ranks)."""

import pytest
from deepspeed.utils import nvtx

from ds_odc.zero._deepspeed_privates import nvtx_ranges_only_under_a_tool


@pytest.mark.parametrize("tool", [None, "/opt/nsight/libToolsInjection64.so"])
def test_deepspeed_nvtx_ranges_stay_on_only_when_a_tool_records_them(monkeypatch, tool):
    monkeypatch.setattr(nvtx, "enable_nvtx", True)
    if tool is None:
        monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    else:
        monkeypatch.setenv("NVTX_INJECTION64_PATH", tool)
    nvtx_ranges_only_under_a_tool()
    assert nvtx.enable_nvtx is (tool is not None)
