"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's
rounding error onto the columns not yet quantized through the inverse Hessian of the
layer's inputs. Symmetric, int8 or int4, per-channel or per-group, optional act-order.
"""

from __future__ import annotations

import torch

from ascend_quant import numerics
from ascend_quant.calibration.observers import mse_weight_scale


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2/N * X^T X over tokens; x: [..., k] -> float64 [k, k] (a float32 product: the
    factorization below is what needs float64)."""
    x = x.reshape(-1, x.shape[-1]).float()
    return ((2.0 / x.shape[0]) * (x.t() @ x)).double()


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int = 0,
                  percdamp: float = 0.01, blocksize: int = 128, act_order: bool = False,
                  mse_scales: bool = True, scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 [n, k] in the original column order, scale [n, 1] or [n, k // g]).

    Scales are fixed before the column sweep (per channel from W, per group from W's
    original columns, optionally MSE-clipped), so that they line up with the checkpoint's
    contiguous groups also under act-order. A given `scale` ([n, 1] or [n, k // g]) is used
    as is (two-stage int4 passes s1 * s2).
    """
    n, k = w.shape
    W = w.detach().float().clone()
    H = h.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    col_weight = torch.diag(H).float()
    if scale is not None:
        scale = scale.float()
    elif mse_scales:
        scale = mse_weight_scale(W.float(), bits, group_size, col_weight=col_weight if group_size else None)
    else:
        scale = numerics.weight_scale(W.float(), bits, group_size)
    scale_full = numerics.expand_groups(scale.float(), k)        # [n, k]
    qmin, qmax = numerics.qrange(bits)

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, H, scale_full = W[:, perm], H[perm][:, perm], scale_full[:, perm]
    mean_diag = torch.mean(torch.diag(H))
    for attempt in range(4):            # more dampening if H is not numerically positive definite
        L, info = torch.linalg.cholesky_ex(H + (percdamp * 10 ** attempt) * mean_diag * torch.eye(k, dtype=H.dtype))
        if info.item() == 0:
            break
    else:
        raise ValueError("GPTQ: the input Hessian is not positive definite even with 1000x dampening")
    Hinv = torch.cholesky_inverse(L)
    Hinv = torch.linalg.cholesky(Hinv, upper=True).float()        # rows: the update directions

    Q = torch.zeros_like(W)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = W1[:, i]
            s = scale_full[:, i1 + i]
            q = torch.clamp(torch.round(col / s), qmin, qmax)
            Q[:, i1 + i] = q
            err = (col - q * s) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return Q[:, inv].to(torch.int8), scale.float()
