"""The normalization in front of ``LayerNormLinear`` and ``LayerNormMLP``.

``normalization="LayerNorm"`` has ``layer_norm_weight`` and ``layer_norm_bias``;
``"RMSNorm"`` has ``layer_norm_weight`` only. With ``zero_centered_gamma=True`` the stored weight
is ``gamma - 1`` (initialised to zeros), otherwise gamma itself (initialised to ones).
The norm parameters always get their gradients through ``.grad`` during ``backward()``.
Their names, shapes and initial values are part of the shared contract
(:meth:`.contract.ModuleContract._add_norm_parameters`).
"""

from __future__ import annotations

import torch

from . import functional as F


def norm_fwd(
    module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Returns ``(ln_out, stats)``; stats are what :func:`norm_bwd` needs besides x. ``weight``
    and ``bias`` are the norm parameters the forward was given; ``module`` gives the options."""
    if module.normalization == "LayerNorm":
        y, mean, rstd = F.layer_norm_fwd(x, weight, bias, module.eps, module.zero_centered_gamma)
        return y, (mean, rstd)
    y, rstd = F.rms_norm_fwd(x, weight, module.eps, module.zero_centered_gamma)
    return y, (rstd,)


def norm_bwd(
    module, d_ln_out, x, weight, stats
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns ``(dx, d_layer_norm_weight, d_layer_norm_bias or None)``."""
    if module.normalization == "LayerNorm":
        mean, rstd = stats
        return F.layer_norm_bwd(d_ln_out, x, weight, mean, rstd, module.zero_centered_gamma)
    (rstd,) = stats
    dx, dgamma = F.rms_norm_bwd(d_ln_out, x, weight, rstd, module.zero_centered_gamma)
    return dx, dgamma, None
