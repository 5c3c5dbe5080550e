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


def test_module_parameters_are_listed_once_for_odc_modules_only():
    """The coordinator's ``iter_params`` gives stock's answer for a listed model, external parameters registered
    later included; a model that was not listed (another engine's, or a deep copy) takes stock's walk."""
    import copy

    import torch
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator
    from deepspeed.runtime.zero.partition_parameters import _init_external_params, register_external_parameter

    from ds_odc.zero._deepspeed_privates import list_module_parameters_once

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
        for sub in m.modules():
            _init_external_params(sub)
        return m

    def walked(module, recurse):  # stock's answer, by its definition
        return [p for _, p in coordinator.get_all_parameters(module, recurse)]

    listed, other = model(), model()
    list_module_parameters_once(listed)
    list_module_parameters_once(listed)  # idempotent: one hook
    assert getattr(coordinator.iter_params, "_ds_odc_hook", False)
    register_external_parameter(listed[1][0], listed[0].weight)  # after listing: still seen
    duplicate = copy.deepcopy(listed)
    for m in (listed, other, duplicate):
        for sub in m.modules():
            for recurse in (False, True):
                assert list(coordinator.iter_params(sub, recurse)) == walked(sub, recurse)
    assert any(p is listed[0].weight for p in coordinator.iter_params(listed[1][0]))
    assert any(p is duplicate[0].weight for p in coordinator.iter_params(duplicate[1][0]))
    assert not set(map(id, coordinator.iter_params(duplicate, True))) & set(map(id, listed.parameters()))
