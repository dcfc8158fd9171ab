"""Every quantization formula of the Ascend checkpoint format, once.

Calibration, the format reader/writer and the runtime reference kernels all call these
functions; nothing else in the package computes a scale, rounds or packs. The formulas
are those of `docs/ascend-format.md` (shared), checked bit for bit against msModelSlim's
own files in the test-suite.

Conventions
-----------
* A Linear weight `w` is `[n, k]` (out, in features; Hugging Face orientation).
* `round` is round-half-to-even (`torch.round`); all arithmetic is float32 unless a
  function says otherwise, because that is what msModelSlim does and what makes its
  files reproducible.
* Granularity is data: a weight scale of shape `[n, 1]` is per-channel, `[n, k // g]`
  is per-group; `expand_groups` broadcasts either to `[n, k]`.

| quantity            | dtype, shape            | formula                                        |
|---------------------|-------------------------|------------------------------------------------|
| weight scale        | float32 [n,1] / [n,k/g] | `max|w| / qmax` (127 for int8, 7 for int4)      |
| asym. weight scale  | float32 [n,1] / [n,k/g] | `(mx - mn) / (qmax - qmin)`, range widened to 0 |
| weight offset       | float32, as the scale   | `qmin - round(mn / scale)`; `w ~= (q - offset) * scale` |
| quantized weight    | int8 [n,k]              | `clamp(round(w / scale), qmin, qmax)`           |
| input scale/offset  | float32 [1]             | `max(mx,0)/255 - min(mn,0)/255`, `round(-mn/s) - 128` |
| deq_scale           | float32 [n] / int64 [n] | `input_scale * weight_scale` (int64 = float32 bits) |
| quant_bias          | int32 [n]               | `round(bias / deq_scale - offset * sum_k w_q)`  |
| scale_bias (W4A8)   | float32 [n, chunks]     | `8 * sum_k(w4 * scale)` per chunk of k          |
| smoothed norm gain  | as the norm [k]         | `w / s`; (1+w) norm (Gemma): `(1 + w) / s - 1`  |
| rotated Linear (R1) | as the weight           | reader `(w · gain) Q`, writer `Qᵀ w` (bias `Qᵀ b`) |
| AWQ factor          | float32 [k]             | `mean|x|^alpha / sqrt(max * min)`               |
| online input rotation | float32 [k] signs d   | Q = diag(d) H / sqrt(k): input `x Q`, stored weight `w Q` |
"""

from __future__ import annotations

import torch

INT8_MIN, INT8_MAX = -128, 127
INT4_MIN, INT4_MAX = -8, 7
# msModelSlim's two-stage int4 quantizes to int8 with this bound first, so that the
# per-group int4 step has headroom (`s1 = max|w| / 119`).
TWO_STAGE_INT8_BOUND = 119
# W4A8 row-parallel layers (o_proj, down_proj) carry scale_bias in this many k-chunks,
# one per possible tensor-parallel rank split.
ROW_PARALLEL_SCALE_BIAS_CHUNKS = 16


def qrange(bits: int) -> tuple[int, int]:
    """Signed integer range of `bits`: (-2^(b-1), 2^(b-1) - 1)."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


# --------------------------------------------------------------------------- scales

def absmax_scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Symmetric scale `absmax / qmax` in float32; an all-zero row gets scale 1.0
    (any scale maps zeros to zero, and 1.0 keeps later divisions finite)."""
    absmax = absmax.float()
    return torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))


def weight_scale(w: torch.Tensor, bits: int, group_size: int = 0) -> torch.Tensor:
    """Symmetric min-max weight scale.

    w: [n, k] float. Returns float32 [n, 1] (group_size 0: per-channel) or
    [n, k // group_size] (per-group). `k` must be divisible by `group_size`.
    """
    n, k = w.shape
    qmax = qrange(bits)[1]
    if group_size:
        check_group_size(k, group_size)
        absmax = w.float().abs().reshape(n, k // group_size, group_size).amax(-1)
    else:
        absmax = w.float().abs().amax(-1, keepdim=True)
    return absmax_scale(absmax, qmax)


def check_group_size(k: int, group_size: int) -> None:
    if group_size <= 0 or k % group_size:
        raise ValueError(
            f"in-features {k} is not divisible by group size {group_size}; "
            f"choose a group size that divides {k} (e.g. 64 or 32)")


def expand_groups(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Broadcast a `[n, 1]` or `[n, k // g]` scale (or offset) to `[n, k]`."""
    groups = scale.shape[-1]
    if groups in (1, k):
        return scale.expand(scale.shape[0], k) if groups == 1 else scale
    assert k % groups == 0, (k, groups)
    return scale.repeat_interleave(k // groups, dim=-1)


def quantize(x: torch.Tensor, scale: torch.Tensor, bits: int,
             offset: torch.Tensor | None = None) -> torch.Tensor:
    """`clamp(round(x / scale) [+ offset], qmin, qmax)` as int8 (int4 values in int8).

    `scale`/`offset` broadcast against `x`; per-group scales are expanded along the
    last dimension first.
    """
    qmin, qmax = qrange(bits)
    if scale.dim() == x.dim() and scale.shape[-1] not in (1, x.shape[-1]):
        scale = expand_groups(scale, x.shape[-1])
        offset = None if offset is None else expand_groups(offset, x.shape[-1])
    q = torch.round(x.float() / scale)
    if offset is not None:
        q = q + offset
    return torch.clamp(q, qmin, qmax).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               offset: torch.Tensor | None = None) -> torch.Tensor:
    """`(q [- offset]) * scale` in float32; per-group scales expand along the last dim."""
    if scale.dim() == q.dim() and scale.shape[-1] not in (1, q.shape[-1]):
        scale = expand_groups(scale, q.shape[-1])
        offset = None if offset is None else expand_groups(offset, q.shape[-1])
    x = q.float()
    if offset is not None:
        x = x - offset
    return x * scale


def unrounded_codes(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """`w / scale [+ offset]` in float32: the values `quantize` rounds and clamps into codes."""
    k = w.shape[-1]
    x = w.float() / expand_groups(scale.float(), k)
    return x if offset is None else x + expand_groups(offset.float(), k)


def tuned_weight(unrounded: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gain: torch.Tensor,
                 offset: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Block tuning's weight (calibration/blocktune.py): the codes `clamp(round(unrounded +
    shift))` dequantized with `scale * (1 + gain)`. The rounding passes gradients through as if
    it were the identity (the straight-through estimator), so `shift` [n, k] and `gain` (shaped
    as `scale`) get gradients; at zero shift and gain this is `dequantize(q, scale, offset)`."""
    qmin, qmax = qrange(bits)
    x = unrounded + shift
    codes = torch.clamp(x + (torch.round(x) - x).detach(), qmin, qmax)
    return dequantize(codes, scale * (1 + gain), offset)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric min-max quantization of a weight: returns (int8 [n, k], scale)."""
    scale = weight_scale(w, bits, group_size)
    return quantize(w, scale, bits), scale


def weight_qparams(w: torch.Tensor, bits: int, group_size: int = 0, symmetric: bool = True,
                   ratio: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max weight (scale, offset) per row or group, the range shrunk by `ratio` (a float,
    or a tensor broadcasting against the scale: a clip ratio per row or group).

    Symmetric: `scale = ratio * max|w| / qmax`, offset None (what `weight_scale` gives at ratio 1).
    Asymmetric: the range `[min(w), max(w)]` widened to include 0 and scaled by `ratio`,
    `scale = (mx - mn) / (qmax - qmin)`, `offset = qmin - round(mn / scale)` (an integer
    within [qmin, qmax]), so that `w ~= (q - offset) * scale` with q in [qmin, qmax]; an
    all-zero group gets scale 1 (its values map to q = offset, dequantized to 0).
    Both float32 [n, 1] or [n, k // g].
    """
    n, k = w.shape
    qmin, qmax = qrange(bits)
    wf = w.float()
    if group_size:
        check_group_size(k, group_size)
        wf = wf.reshape(n, k // group_size, group_size)
    else:
        wf = wf.unsqueeze(1)
    ratio = torch.as_tensor(ratio, dtype=torch.float32)
    if symmetric:
        return absmax_scale(wf.abs().amax(-1) * ratio, qmax), None
    mn = torch.clamp(wf.amin(-1), max=0.0) * ratio
    mx = torch.clamp(wf.amax(-1), min=0.0) * ratio
    scale = absmax_scale(mx - mn, qmax - qmin)
    return scale, qmin - torch.round(mn / scale)


def fake_quantize_weight(w: torch.Tensor, scale: torch.Tensor, bits: int,
                         offset: torch.Tensor | None = None) -> torch.Tensor:
    """`dequantize(quantize(w, scale, bits, offset), scale, offset)`: w [n, k] as its integer
    weights compute (float32)."""
    return dequantize(quantize(w, scale, bits, offset), scale, offset)


def two_stage_int4(w: torch.Tensor, group_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """msModelSlim's two-stage per-group int4 (W4A8_DYNAMIC, older Calibrator).

    Stage 1: int8 per channel with bound 119: `s1 = max_k|w| / 119`, `w8 = round(w / s1)`.
    Stage 2: int4 per group on the int8 values: `s2 = round(max_g|w8| / 7)` (an integer,
    at least 1), `w4 = clamp(round(w8 / s2), -8, 7)`.
    Returns (w4 int8 [n, k], s1 float32 [n, 1], s2 float32 [n, k // g]);
    `w ~= w4 * s2 * s1`.
    """
    n, k = w.shape
    check_group_size(k, group_size)
    s1 = absmax_scale(w.float().abs().amax(-1, keepdim=True), TWO_STAGE_INT8_BOUND)
    w8 = torch.round(w.float() / s1)
    groups = w8.reshape(n, k // group_size, group_size)
    s2 = torch.clamp(torch.round(groups.abs().amax(-1) / INT4_MAX), min=1.0)
    w4 = torch.clamp(torch.round(groups / s2.unsqueeze(-1)), INT4_MIN, INT4_MAX)
    return w4.reshape(n, k).to(torch.int8), s1, s2


def two_stage_second_scale(w: torch.Tensor, s1: torch.Tensor, group_scale: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """The integer stage-2 scales s2 [n, k/g] for a wanted per-group scale (float32 [n, k/g]):
    of floor and ceil of `group_scale / s1` (within [1, 127]), the one whose round-to-nearest
    int4 reconstruction of the group, `clamp(round(w / s), -8, 7) * s` with
    `s = two_stage_scale(s1, s2)`, has the smaller squared error (ties: the larger s2, no
    clipping). Rounding the ratio instead can miss the wanted scale by up to 1/(2 s2): 17%
    for a group whose max is a fifth of its row's (s2 near 3)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    ratio = group_scale.float() / s1.float()
    candidates = [torch.clamp(f(ratio), 1.0, 127.0) for f in (torch.ceil, torch.floor)]

    def error(s2: torch.Tensor) -> torch.Tensor:
        s = two_stage_scale(s1, s2).unsqueeze(-1)
        return (torch.clamp(torch.round(wg / s), INT4_MIN, INT4_MAX) * s - wg).square().sum(-1)

    hi, lo = candidates
    return torch.where(error(hi) <= error(lo), hi, lo)


def two_stage_int8(w4: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two-stage int4 as one int8 weight per channel: `w8 = w4 * s2` (int8 [n, k]) with the
    channel scale `bf16(s1)` (float32 [n]), so that `w8 * bf16(s1) = w4 * two_stage_scale(s1, s2)`
    exactly and an int8 activation's integer dot product with w8 is the group-scaled sum of its
    dot products with w4. None where that is not exact: an s2 that is not an integer, or a
    product outside int8. w4: int values [n, k]; s1 [n] or [n, 1]; s2 [n, k / g]."""
    n, k = w4.shape
    s2 = s2.float().reshape(n, -1)
    if not bool(torch.all(s2 == torch.round(s2))) or k % s2.shape[1]:
        return None
    w8 = w4.to(torch.int32) * s2.to(torch.int32).repeat_interleave(k // s2.shape[1], dim=1)
    if w8.numel() and (int(w8.min()) < -128 or int(w8.max()) > 127):
        return None
    return w8.to(torch.int8), s1.reshape(-1).to(torch.bfloat16).float()


def two_stage_scale(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The effective per-group scale of two-stage int4, `s2 * bf16(s1)`, float32 [n, k/g].

    The stage-1 scale is rounded to bf16 first: that is the precision the NPU kernel
    holds it in, and what msModelSlim's `scale_bias` is computed from.
    """
    return s2.float() * s1.to(torch.bfloat16).float()


# --------------------------------------------------------------------- activations

def activation_qparams(x_min: torch.Tensor | float, x_max: torch.Tensor | float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Static per-tensor asymmetric int8 parameters from an observed range.

    The range is widened to include 0 (`mn = min(x_min, 0)`, `mx = max(x_max, 0)`),
    `scale = mx / 255 - mn / 255` (msModelSlim v1 divides first, then subtracts: within
    1 ulp of `(mx - mn) / 255`, and bit-identical to its files), `offset = round(-mn / scale) - 128`.
    Both float32 [1] (or [m] for m ranges at once). A degenerate range (all zeros) gets scale 1 (zero maps to -128).
    """
    mn = torch.clamp(torch.as_tensor(x_min, dtype=torch.float32).reshape(-1), max=0.0)
    mx = torch.clamp(torch.as_tensor(x_max, dtype=torch.float32).reshape(-1), min=0.0)
    levels = float(INT8_MAX - INT8_MIN)
    scale = mx / levels - mn / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    offset = torch.round(-mn / scale) + INT8_MIN
    return scale, offset


def quantize_activation_static(x: torch.Tensor, input_scale: torch.Tensor,
                               input_offset: torch.Tensor, bf16_params: bool = True
                               ) -> torch.Tensor:
    """What `npu_quantize(x, 1/s, o, qint8, -1, div_mode=False)` computes:
    `clamp(round(x * (1/s) + o), -128, 127)`.

    With `bf16_params` the reciprocal scale and the offset are rounded to bf16 first, as
    vllm-ascend does on load; the multiply-add itself runs in float32.
    """
    inv, offset = static_activation_params(input_scale, input_offset, bf16_params)
    q = torch.round(x.float() * inv + offset)
    return torch.clamp(q, INT8_MIN, INT8_MAX).to(torch.int8)


def static_activation_params(input_scale: torch.Tensor, input_offset: torch.Tensor, bf16_params: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 multiplier and offset of `quantize_activation_static`: 1/s and o, each rounded
    to bf16 first with `bf16_params` (as vllm-ascend rounds them on load)."""
    inv = 1.0 / input_scale.float()
    offset = input_offset.float()
    if bf16_params:
        inv = inv.to(torch.bfloat16).float()
        offset = offset.to(torch.bfloat16).float()
    return inv, offset


def quantize_activation_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (`npu_dynamic_quant`): `s_t = max|x[t,:]| / 127`,
    `x_q = round(x / s_t)`. x: [..., k]. Returns (int8 [..., k], float32 [..., 1])."""
    scale = absmax_scale(x.float().abs().amax(-1, keepdim=True), INT8_MAX)
    return quantize(x, scale, 8), scale


def fake_quantize_activation_dynamic(x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """`dequantize(*quantize_activation_dynamic(x))` in x's dtype, the same values bit for bit,
    computed with in-place ops on one float32 copy (the calibrator runs it on every
    activation), or on x itself with `in_place` (float32 x)."""
    absmax = torch.maximum(x.amax(-1, keepdim=True), -x.amin(-1, keepdim=True))
    scale = absmax_scale(absmax, INT8_MAX)
    if in_place:
        assert x.dtype == torch.float32, x.dtype
        y = x.div_(scale)
    else:
        y = x.float() / scale
    return y.round_().clamp_(INT8_MIN, INT8_MAX).mul_(scale).to(x.dtype)


# ------------------------------------------------------------------- smoothing fold

def smoothed_norm_gain(w: torch.Tensor, s: torch.Tensor, offset: bool = False) -> torch.Tensor:
    """The RMSNorm gain w [k] after dividing the norm's output by s [k] (float32 arithmetic,
    returned in w's dtype). A plain norm (x̂ · w) gives w / s; a (1+w) norm (x̂ · (1 + w), Gemma)
    gives (1 + w) / s - 1, so that 1 + w' = (1 + w) / s: w = 0, s = 2 -> w' = -0.5."""
    wf, sf = w.float(), s.float()
    return ((1.0 + wf) / sf - 1.0 if offset else wf / sf).to(w.dtype)


def awq_factors(act_mean: torch.Tensor, alpha: float, eps: float = 1e-5) -> torch.Tensor:
    """AWQ's activation-aware per-channel factor s [k] = mean|x|^alpha, normalized so that
    max(s) * min(s) = 1 (a common factor changes nothing for min-max weights; this keeps the
    folded norm gains and weights near their magnitudes). alpha 0 gives all ones: no scaling.
    act_mean: [k] mean absolute activation per input channel."""
    return _centred(act_mean.float().clamp(min=eps).pow(alpha), eps)


def _centred(s: torch.Tensor, eps: float) -> torch.Tensor:
    """s [k] divided by sqrt(max(s) * min(s)), so that max * min = 1 (AWQ's normalization)."""
    return (s / torch.sqrt(s.amax() * s.amin())).clamp(min=eps)


def awq_weight_mean(w: torch.Tensor, group_size: int = 0) -> torch.Tensor:
    """Per input channel [k], the mean over the rows of w [n, k] of |w| relative to the largest
    |w| of its row's group (group_size 0: the whole row): how much of the quantization range a
    column already uses, the weight side of AWQ's two-sided factor."""
    n, k = w.shape
    g = group_size or k
    a = w.float().abs().reshape(n, k // g, g)
    return (a / a.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(n, k).mean(0)


def awq_duo_factors(act_mean: torch.Tensor, weight_mean: torch.Tensor, alpha: float,
                    eps: float = 1e-5) -> torch.Tensor:
    """AWQ's two-sided factor s [k] = mean|x|^alpha / weight_mean^(1 - alpha) (weight_mean from
    `awq_weight_mean`), normalized as `awq_factors`: channels whose weights use little of
    their range are scaled up more. alpha 1 is `awq_factors`' alpha 1."""
    return _centred(act_mean.float().clamp(min=eps).pow(alpha) / weight_mean.float().clamp(min=eps).pow(1.0 - alpha),
                    eps)


# ------------------------------------------------------------------- offline rotations

def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[a, b] = chi(b - a) for a prime q, chi the quadratic character mod q (chi(0) = 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if r in squares else -1 for r in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley(c: int) -> torch.Tensor | None:
    """A Hadamard matrix of order c from Paley's constructions over a prime field, or None.
    I: q = c - 1 prime, q = 3 mod 4: H = I + [[0, 1ᵀ], [-1, Q]]. II: q = c / 2 - 1 prime,
    q = 1 mod 4: the conference matrix C = [[0, 1ᵀ], [1, Q]] with every 0 replaced by
    [[1, -1], [-1, -1]] and every ±1 by ±[[1, 1], [1, -1]]."""
    if c == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    q = c - 1
    if _is_prime(q) and q % 4 == 3:
        s = torch.zeros(c, c, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(c, dtype=torch.float64) + s
    q = c // 2 - 1
    if c % 2 == 0 and _is_prime(q) and q % 4 == 1:
        conf = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        conf[0, 1:], conf[1:, 0], conf[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(conf, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order n (entries ±1, H Hᵀ = n I) as float64, or None where this
    construction has none: n = 2^a · c, H = H2^(⊗(a-b)) ⊗ P_c for the first b with a Paley
    matrix P_c of order c = (n / 2^a) · 2^b (Sylvester doubling of a Paley core). Covers every
    power of two and e.g. 576 = 16 · 36 (Paley II, q = 17), 640 = 32 · 20, 896 = 32 · 28,
    1536 = 128 · 12."""
    parts = hadamard_parts(n)
    if parts is None:
        return None
    core, doublings = parts
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    for _ in range(doublings):
        core = torch.kron(h2, core)
    return core


def hadamard_parts(n: int) -> tuple[torch.Tensor, int] | None:
    """(P, r) with `hadamard(n)` = H2^(⊗r) ⊗ P (P a Paley core, float64), or None."""
    if n < 1:
        return None
    a, odd = 0, n
    while odd % 2 == 0:
        a, odd = a + 1, odd // 2
    for b in range(a + 1):
        core = _paley(odd << b)
        if core is not None:
            return core, a - b
    return None


def orthogonal_rotation(n: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """An n x n orthogonal matrix, float64. `hadamard`: a randomized Hadamard D·H / sqrt(n)
    (D a random ±1 diagonal), ValueError for an n `hadamard` cannot build; `random`: the Q of
    a QR of a Gaussian matrix, signs fixed by R's diagonal (Haar-distributed)."""
    if kind == "hadamard":
        h = hadamard(n)
        if h is None:
            raise ValueError(f"no Hadamard matrix of order {n} here (2^a times a Paley order); "
                             "use rotation kind random")
        signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
        return signs[:, None] * h / n ** 0.5
    if kind == "random":
        g = torch.randn(n, n, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        return q * torch.sign(torch.diagonal(r))[None, :]
    raise ValueError(f"unknown rotation kind {kind!r} (hadamard or random)")


def rotation_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """n random ±1 values, float32: the diagonal D of a randomized Hadamard D·H / sqrt(n)."""
    return torch.randint(0, 2, (n,), generator=generator).to(torch.float32) * 2 - 1


def input_rotation(signs: torch.Tensor) -> torch.Tensor:
    """The online rotation Q = diag(signs)·H / sqrt(k) (float64 [k, k], orthogonal) of a
    Linear that stores `input_rotation` signs [k]: it computes (x·Q)·w'ᵀ with w' = w·Q
    (`rotate_input`), the float product x·wᵀ. ValueError for a k `hadamard` cannot build."""
    k = signs.numel()
    h = hadamard(k)
    if h is None:
        raise ValueError(f"no Hadamard matrix of order {k} here (2^a times a Paley order)")
    return signs.reshape(k, 1).to(torch.float64) * h / k ** 0.5


def rotation_factors(n: int, block: int = 64) -> tuple[torch.Tensor, ...] | None:
    """`hadamard(n)` as a Kronecker product F_1 ⊗ ... ⊗ F_j (float64) of Sylvester blocks of
    order <= `block` and the Paley core last, for `rotate_activation`; None where `hadamard`
    has none."""
    parts = hadamard_parts(n)
    if parts is None:
        return None
    core, r = parts
    pieces = -(-r // max(1, block.bit_length() - 1))            # as few blocks as `block` allows,
    chunks = [r // pieces + (i < r % pieces) for i in range(pieces)]   # of near-equal orders
    blocks = tuple(hadamard(1 << c) for c in chunks)
    return blocks if core.shape[0] == 1 and blocks else (*blocks, core)


def rotate_activation(x: torch.Tensor, signs: torch.Tensor, factors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x·Q for Q = `input_rotation(signs)` without forming Q (`factors` from `rotation_factors`,
    in x's dtype and device): x·(F_1 ⊗ F_2 ⊗ ... ⊗ P) is F_1ᵀ, F_2ᵀ, ... applied from the left
    to x·diag(signs) viewed as [n_1, n_2, ..., c] and P from the right, one matmul each:
    O(k (n_1 + ... + c)) per row instead of O(k²). Torch ops only (compiled mode traces it)."""
    k = signs.numel()
    y = x * signs
    rows = y.numel() // k
    for f in factors[:-1]:
        y = f.t() @ y.reshape(rows, f.shape[0], -1)
        rows *= f.shape[0]
    y = y.reshape(-1, factors[-1].shape[0]) @ factors[-1]
    return (y * (1.0 / k ** 0.5)).reshape(x.shape)


def fold_norm_gain(w: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """A Linear w [n, k] reading `x̂ · gain` rewritten to read x̂: w · gain per column."""
    return w * gain[None, :].to(w.dtype)


def rotate_input(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A Linear w [n, k] whose input x becomes x·Q (Q [k, k] orthogonal): w' = w·Q, so that
    (x·Q)·w'ᵀ = x·wᵀ. Float64 arithmetic, w's dtype back."""
    return (w.double() @ q.double()).to(w.dtype)


def rotate_output(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A Linear w [n, k] (or a bias [n]) whose output y must become y·Q: w' = Qᵀ·w."""
    return (q.double().t() @ w.double()).to(w.dtype) if w.dim() == 2 else \
        (w.double() @ q.double()).to(w.dtype)


def rotate_head_rows(w: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
    """v_proj's w [h·d, k] (or bias [h·d]) with head j's output rotated by rs[j] [d, d]:
    rows of head j become rs[j]ᵀ · w_j."""
    h, d, _ = rs.shape
    blocks = w.double().reshape(h, d, -1)
    return torch.einsum("hed,hek->hdk", rs.double(), blocks).reshape(w.shape).to(w.dtype)


def rotate_head_columns(w: torch.Tensor, rs: torch.Tensor, group: int) -> torch.Tensor:
    """o_proj's w [n, heads·d] reading heads rotated by their KV head's matrix (head i by
    rs[i // group], `group` query heads per KV head, GQA): columns of head i become w_i · rs[i // group]."""
    n = w.shape[0]
    r = rs.double().repeat_interleave(group, dim=0)              # [heads, d, d]
    heads, d, _ = r.shape
    blocks = w.double().reshape(n, heads, d)
    return torch.einsum("nhd,hde->nhe", blocks, r).reshape(w.shape).to(w.dtype)


# -------------------------------------------------------------- W8A8 static tensors

def deq_scale(input_scale: torch.Tensor, weight_scale_: torch.Tensor) -> torch.Tensor:
    """`input_scale * weight_scale` as float32 [n] (weight scale [n] or [n, 1])."""
    return (input_scale.float().reshape(1) * weight_scale_.float().reshape(-1))


def encode_deq_scale(deq: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """deq_scale as stored: float32 for bf16 models, else int64 holding the float32 bits
    (what the fp16 NPU kernel reads)."""
    deq = deq.float().contiguous()
    if model_dtype == torch.bfloat16:
        return deq
    return deq.view(torch.int32).to(torch.int64)


def decode_deq_scale(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode_deq_scale`: float32 [n] from either encoding."""
    if stored.dtype == torch.int64:
        return stored.to(torch.int32).view(torch.float32)
    return stored.float()


def deq_scale_dtype_for(model_dtype: torch.dtype) -> torch.dtype:
    """The stored deq_scale dtype that vllm-ascend accepts for a serving dtype."""
    return torch.float32 if model_dtype == torch.bfloat16 else torch.int64


def quant_bias(bias: torch.Tensor | None, deq: torch.Tensor, input_offset: torch.Tensor,
               w_q: torch.Tensor) -> torch.Tensor:
    """int32 [n]: `round(bias / deq_scale - input_offset * sum_k w_q[n, k])`.

    Folds the float bias and the activation zero point into the int32 accumulator, so
    that `y = (x_q @ w_q^T + quant_bias) * deq_scale`.
    """
    n = w_q.shape[0]
    b = torch.zeros(n) if bias is None else bias.float()
    row_sum = w_q.to(torch.int32).sum(-1).float()
    return torch.round(b / deq.float() - input_offset.float() * row_sum).to(torch.int32)


# ------------------------------------------------------------------- int4 packing

def pack_int4(w4: torch.Tensor) -> torch.Tensor:
    """Pack int4 values [n, k] (in int8) two per byte along n: int8 [n/2, k],
    `packed[j] = (w4[2j] & 0xF) | (w4[2j+1] << 4)`."""
    n = w4.shape[0]
    if n % 2:
        raise ValueError(f"int4 packing along n needs an even out-feature count, got {n}")
    lo, hi = w4[0::2].to(torch.int8), w4[1::2].to(torch.int8)
    return ((lo & 0xF) | (hi << 4)).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: int8 [n/2, k] -> int4 values in int8 [n, k]."""
    lo = (packed << 4) >> 4          # arithmetic shift sign-extends the low nibble
    hi = packed >> 4
    return torch.stack((lo, hi), dim=1).reshape(-1, packed.shape[-1])


def int4_to_npu_int32(w4: torch.Tensor) -> torch.Tensor:
    """int4 values [n, k] -> the int32 [k, n/8] view the NPU weight-quant matmul takes:
    transposed, eight consecutive output channels per word, lowest nibble first."""
    n, k = w4.shape
    if n % 8:
        raise ValueError(f"the NPU int32 int4 layout needs n divisible by 8, got {n}")
    nibbles = (w4.t().to(torch.int64) & 0xF).reshape(k, n // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (nibbles << shifts).sum(-1)                     # [k, n/8], 0 .. 2^32-1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def npu_int32_to_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `int4_to_npu_int32`: int32 [k, n/8] -> int4 values int8 [n, k]."""
    k, n8 = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nib = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF   # [k, n/8, 8]
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(k, n8 * 8).t().contiguous().to(torch.int8)


def scale_bias(w4: torch.Tensor, scale: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """W4A8 `scale_bias`: float32 [n, chunks] = `8 * sum_k(w4 * scale)` over each of
    `chunks` contiguous pieces of k. `scale` is [n, 1] or per-group [n, k/g]
    (for two-stage int4 pass `two_stage_scale(s1, s2)`). The NPU int4 x int8 kernel uses
    it to undo its +8 bias on the int4 operand."""
    n, k = w4.shape
    if k % chunks:
        raise ValueError(f"in-features {k} do not split into {chunks} scale_bias chunks")
    weighted = w4.float() * expand_groups(scale.float(), k)
    return weighted.reshape(n, chunks, k // chunks).sum(-1) * 8


def scale_bias_chunks(row_parallel: bool) -> int:
    """How many k-chunks a W4A8 layer's scale_bias has (16 for o_proj/down_proj)."""
    return ROW_PARALLEL_SCALE_BIAS_CHUNKS if row_parallel else 1
