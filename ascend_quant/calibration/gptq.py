"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's
rounding error onto the columns not yet quantized through the inverse Hessian of the
layer's inputs. Int8 or int4, per-channel or per-group, optional act-order; symmetric, or
asymmetric with given zero points.
"""

from __future__ import annotations

import torch

from ascend_quant import native, numerics
from ascend_quant.calibration.observers import mse_weight_scale


def hessian(x: torch.Tensor, band: int = 256) -> torch.Tensor:
    """H = 2/N * X^T X over tokens; x: [..., k] -> float64 [k, k] (a float32 product: the
    factorization below is what needs float64). H is symmetric, so only the bands on and
    above the diagonal are multiplied (about 60% of the full product's work at k = 1536)."""
    x = x.reshape(-1, x.shape[-1]).float()
    k = x.shape[1]
    h = torch.empty(k, k)
    for i in range(0, k, band):
        upper = x[:, i:i + band].t() @ x[:, i:]          # rows i..i+band, columns i..k
        h[i:i + band, i:] = upper
        h[i:, i:i + band] = upper.t()
    return (h.mul_(2.0 / x.shape[0])).double()


def float_target_weight(w: torch.Tensor, x_q: torch.Tensor, x_f: torch.Tensor, percdamp: float = 0.01,
                        share: float = 1.0) -> torch.Tensor:
    """The weight [n, k] whose output on the input the layer really gets, x_q [t, k] (after the
    quantized layers before it), best matches the float model's output w x_f (x_f [t, k], the
    same tokens): the ridge least-squares solution W* = W + W D^T X_q (X_q^T X_q + lambda I)^-1
    with D = X_f - X_q and lambda = percdamp * mean(diag(X_q^T X_q)), GPTQ's dampening.

    GPTQ on W* with X_q's Hessian then minimizes |X_f W^T - X_q Q^T|^2, the float target of
    GPTAQ (Li et al., 2025, "asymmetric calibration"): the two differ by a constant, since the
    least-squares residual X_f W^T - X_q W*^T is orthogonal to every X_q V^T (up to the ridge
    term). So each layer also corrects the drift the quantized layers before it left.
    `share` < 1 moves W only that part of the way to W* (`gptq.float_target_share`)."""
    xq = x_q.reshape(-1, x_q.shape[-1]).float()
    d = x_f.reshape(-1, x_f.shape[-1]).float() - xq
    h = (xq.t() @ xq).double()                       # float32 products, a float64 solve
    diag = h.diagonal()
    diag.add_(percdamp * diag.mean().item() + 1e-12)
    rhs = (xq.t() @ d).double() @ w.double().t()     # X_q^T D W^T  [k, n]
    del d
    L, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:                             # not positive definite even damped: no correction
        return w.float()
    return (w.double() + share * torch.cholesky_solve(rhs, L).t()).float()


def _inverse_cholesky_upper(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """U (float32), the upper Cholesky factor of (H + damp I)^-1, which GPTQ's sweep needs.

    With J the reversal permutation, chol(J H J) = L gives H = R R^T for the upper
    triangular R = J L J, so U = R^-1: one factorization and one triangular inverse instead
    of factor, invert, factor. At most two k x k float64 matrices live at once."""
    k = H.shape[0]
    flipped = H.flip(0, 1)                       # a copy: H itself is left alone
    diag = flipped.diagonal()
    step = percdamp * torch.mean(diag).item()
    diag.add_(step)
    for attempt in range(4):            # more dampening if H is not numerically positive definite
        L, info = torch.linalg.cholesky_ex(flipped)
        if info.item() == 0:
            break
        del L
        diag.add_(step * (10 ** (attempt + 1) - 10 ** attempt))
    else:
        raise ValueError("GPTQ: the input Hessian is not positive definite even with 1000x dampening")
    del flipped, diag
    R = L.flip(0, 1).float()          # the factorization needs float64; the inverse does not
    del L
    return torch.linalg.solve_triangular(R, torch.eye(k), upper=True).contiguous()


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int = 0,
                  percdamp: float = 0.01, blocksize: int = 128, act_order: bool = False,
                  mse_scales: bool = True, scale: torch.Tensor | None = None, native_sweep: bool = True,
                  offset: torch.Tensor | None = None, unrounded: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 [n, k] in the original column order, scale [n, 1] or [n, k // g]).

    Scales are fixed before the column sweep (per channel from W, per group from W's
    original columns, optionally MSE-clipped), so that they line up with the checkpoint's
    contiguous groups also under act-order. A given `scale` ([n, 1] or [n, k // g]) is used
    as is (two-stage int4 passes s1 * s2), with its zero points `offset` (same shape, integer
    values) if asymmetric: the returned q then dequantizes as `(q - offset) * scale`.
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
    if offset is not None:
        # the grid {(q - o) s : q in [qmin, qmax]} is the symmetric grid {q s} moved by -o s: the
        # sweep runs on W + o s (an integer-step shift of each group), its rounding errors and
        # so its updates are those of W on the asymmetric grid, and its q are the stored ones
        W += numerics.expand_groups(offset.float(), k) * scale_full
    qmin, qmax = numerics.qrange(bits)

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, scale_full = W[:, perm], scale_full[:, perm]
    if act_order:
        H = H[perm][:, perm]
    Hinv = _inverse_cholesky_upper(H, percdamp)
    del H

    # The sweep works on the transpose: column i of W is the contiguous row Wt[i], and the
    # rank-1 update of the block's remaining columns is one BLAS ger (addr_) per column.
    # Rows of W are independent, so stacking the members of a fused group (q/k/v, gate/up:
    # one shared Hessian) into one call is exact and shares the per-column overhead.
    Wt, St = W.t().contiguous(), scale_full.t().contiguous()
    del W, scale_full
    Qt = torch.empty_like(Wt)
    Ut = torch.empty_like(Wt) if unrounded is not None else None
    lib = native.GPTQ.load() if native_sweep else None
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1, Hinv1 = Wt[i1:i2], Hinv[i1:i2, i1:i2]
        Err1 = torch.empty_like(W1)
        if lib is not None:          # the same sweep in C (native/gptq_kernel.c)
            lib.gptq_sweep_block(W1.data_ptr(), St[i1:i2].data_ptr(), Qt[i1:i2].data_ptr(), Err1.data_ptr(),
                                 Hinv1.data_ptr(), i2 - i1, n, Hinv.stride(0), float(qmin), float(qmax))
        else:
            inv_diag = (1.0 / torch.diagonal(Hinv1)).tolist()
            for i in range(i2 - i1):
                w, s, q, err = W1[i], St[i1 + i], Qt[i1 + i], Err1[i]
                torch.div(w, s, out=q).round_().clamp_(qmin, qmax)
                torch.addcmul(w, q, s, value=-1.0, out=err).mul_(inv_diag[i])   # (w - q s) / Hinv[i, i]
                if i + 1 < i2 - i1:
                    W1[i + 1:].addr_(Hinv1[i, i + 1:], err, alpha=-1.0)
        if Ut is not None:       # err = (w - q s) / Hinv_ii, so the column rounded was w / s = q + err Hinv_ii / s
            torch.addcdiv(Qt[i1:i2], Err1 * torch.diagonal(Hinv1)[:, None], St[i1:i2], out=Ut[i1:i2])
        if i2 < k:
            Wt[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1.0)
    inv = torch.argsort(perm)
    if Ut is not None:
        unrounded.copy_(Ut[inv].t())
    return Qt[inv].t().to(torch.int8).contiguous(), scale.float()


def refit_scales(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 h: torch.Tensor, codes_scale: torch.Tensor | None = None, rows_per_chunk: int = 256,
                 ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Least-squares scales (and zero points) for integer codes that are already chosen.

    Rounding (min-max, GPTQ) fixes `scale` [n, G] before it picks the codes q [n, k]. With the
    codes fixed, the dequantized row is linear in its per-group parameters, w_hat_i =
    a_g q_i + b_g over group g (a = scale, b = -offset * scale; b = 0 when `offset` is None),
    so the (a, b) minimizing the layer's output error on the calibration inputs,
    (w - w_hat) H (w - w_hat)^T with H = X^T X [k, k], solve a 2G x 2G (G x G) system per row.
    `codes_scale` [n, k] multiplies the codes first (two-stage int4: s2, so `scale` is s1
    [n, 1]). The solve is damped toward the current parameters (`ridge` times the system's
    diagonal) so that groups whose codes cannot tell a from b keep theirs; a row keeps its old
    parameters unless the new ones are finite, positive and lower its error.
    Returns (scale, offset) shaped as given."""
    n, k = q.shape
    G = scale.shape[1]
    gs = k // G
    H = h.float()
    Hb = H.reshape(G, gs, k)
    Hbb = H.reshape(G, gs, G, gs).sum((1, 3))                       # [G, G]: sums of H's blocks
    asym = offset is not None
    new_scale, new_offset = scale.float().clone(), None if offset is None else offset.float().clone()
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, n)
        Q = q[r0:r1].float()
        if codes_scale is not None:
            Q = Q * codes_scale[r0:r1].float()
        m = r1 - r0
        Qg = Q.reshape(m, G, gs)
        WH = w[r0:r1].float() @ H                                    # [m, k]
        T = torch.einsum("rgi,gij->rgj", Qg, Hb).reshape(m, G, G, gs)  # T[r, g, g', j] = sum_i in g q_i H_ij
        Maa = (T * Qg.unsqueeze(1)).sum(-1)                          # [m, G, G]
        va = (WH.reshape(m, G, gs) * Qg).sum(-1)                     # [m, G]
        a0 = scale[r0:r1].float()
        if asym:
            Mab = T.sum(-1)                                          # [m, G, G]: a_g with b_g'
            M = torch.cat([torch.cat([Maa, Mab], 2), torch.cat([Mab.transpose(1, 2), Hbb.expand(m, G, G)], 2)], 1)
            v = torch.cat([va, WH.reshape(m, G, gs).sum(-1)], 1)
            theta0 = torch.cat([a0, -offset[r0:r1].float() * a0], 1)
        else:
            M, v, theta0 = Maa, va, a0
        M, v, theta0 = M.double(), v.double(), theta0.double()
        d = M.diagonal(dim1=1, dim2=2).clamp(min=1e-30) * ridge
        theta = torch.linalg.solve(M + torch.diag_embed(d), (v + d * theta0).unsqueeze(-1)).squeeze(-1)

        def err(t):                                                  # the error up to a constant
            return (t.unsqueeze(1) @ M @ t.unsqueeze(-1)).squeeze((1, 2)) - 2 * (v * t).sum(1)
        a = theta[:, :G]
        ok = torch.isfinite(theta).all(1) & (a > 0).all(1) & (err(theta) < err(theta0))
        if not ok.any():
            continue
        rows = torch.arange(r0, r1)[ok]
        new_scale[rows] = a[ok].float()
        if asym:
            new_offset[rows] = (-theta[ok, G:] / a[ok]).float()
    return new_scale.to(scale.dtype), None if offset is None else new_offset.to(offset.dtype)
