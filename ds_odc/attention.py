"""Attention kernels for variable-length training.

``restrict_sdpa_backends``: limit the kernels torch's ``scaled_dot_product_attention`` may choose from.
"""

from __future__ import annotations

import torch

__all__ = ["restrict_sdpa_backends"]

_SDPA_SWITCHES = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp",
                  "math": "enable_math_sdp"}


def restrict_sdpa_backends(backends: str | None) -> None:
    """Let sdpa use only the comma-listed kernels (``flash``, ``efficient``, ``cudnn``, ``math``), process-wide.

    ``None`` or ``""`` leaves torch's choice alone. cuDNN builds a plan on the host for every new sequence length,
    which variable-length training pays at every layer call."""
    if not backends:
        return
    allowed = {b.strip() for b in backends.split(",") if b.strip()}
    unknown = allowed - _SDPA_SWITCHES.keys()
    if unknown:
        raise ValueError(f"sdpa backends: unknown {sorted(unknown)}; choose from {sorted(_SDPA_SWITCHES)}")
    for name, switch in _SDPA_SWITCHES.items():
        getattr(torch.backends.cuda, switch)(name in allowed)
