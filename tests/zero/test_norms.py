"""ODC's gradient norm adds its squares up as stock ZeRO-3 does (in float64 where the device has it), whatever the
CPU's vector kernels: one fp32 sum over a whole accumulator rounds once per element and drifted 34 ulps on an AMD
EPYC's kernels (300,001 elements), which a logged ``grad_norm`` compared with stock's then showed."""

import torch

from ds_odc.zero.norms import sum_of_squares
from deepspeed.runtime.zero.utils import get_norm_dtype


def test_sum_of_squares_is_the_float64_sum_within_a_few_ulps():
    g = torch.Generator().manual_seed(0)
    for n in (1, 255, 256, 1000, 300_001):
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4  # magnitudes spread over decades
        got, exact = sum_of_squares(grad), grad.double().square().sum()
        assert got.dtype == get_norm_dtype() and got.dim() == 0
        # each row of 256 squares rounds in fp32 a few times; the rows add up in float64
        bound = 4 * torch.finfo(torch.float32).eps * float(exact)
        assert abs(float(got - exact)) <= bound, (n, float(got), float(exact))
    assert float(sum_of_squares(torch.zeros(0))) == 0.0
