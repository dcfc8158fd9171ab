"""What every scheme file provides, and the one in-memory quantized Linear they pack and unpack.

A scheme answers, for one Linear of `n` out- and `k` in-features:

- `tensor_specs(n, k, ...)`: its checkpoint tensors by suffix (on-disk dtypes, shape, the vLLM
  parameter kind that shards it across tensor-parallel ranks);
- `pack(ql, model_dtype)` / `unpack(tensors)`: between a `QuantizedLinear` and those tensors;
- `prepare(tensors, backend, ...)` / `forward(linear, x, bias)`: the kernel ops that serve it;
- `fake_quant_input(x, ql)`: the activations its Linears compute with (calibration).

Nothing outside `ascend_quant.schemes` compares a scheme name: it asks the scheme.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ascend_quant import numerics

# vLLM parameter kinds (runtime/vllm/linear.py maps them to vLLM's parameter classes):
#   weight        int8 [n, k], sharded along n and k
#   packed_weight int4 pairs packed along n: int8 [n/2, k]
#   per_shard     one value per fused shard (q/k/v, gate/up), e.g. static input_scale
#   channel       [n] or [n, 1], sharded along n
#   group         [n, k/g], sharded along n and (row-parallel) along k
PARAM_KINDS = ("weight", "packed_weight", "per_shard", "channel", "group")
# a Linear computed on x·Q (an online input rotation; numerics.input_rotation) stores Q's signs
# as this FLOAT float32 [k] tensor beside its weight, which holds w·Q; any scheme, FLOAT included
INPUT_ROTATION = "input_rotation"
_F32 = (torch.float32,)


class SchemeError(ValueError):
    """Tensors that do not form a valid Linear of their scheme (one line, naming where)."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype                  # in memory and in vLLM's parameter
    shape: tuple[int, ...]              # on disk, for this Linear (or this rank's partition)
    param: str                          # one of PARAM_KINDS
    disk_dtypes: tuple[torch.dtype, ...] = ()   # accepted on disk (default: dtype alone)
    on_load: Optional[Callable[[torch.Tensor], torch.Tensor]] = None   # applied by the vLLM loader

    @property
    def accepted(self) -> tuple[torch.dtype, ...]:
        return self.disk_dtypes or (self.dtype,)


@dataclass
class QuantizedLinear:
    """One Linear's quantized form: what calibration produces, the writer packs, convert and
    the checkpoint tools unpack. Integer values are unpacked ([n, k], int4 as int8)."""
    scheme: str
    q: torch.Tensor                          # int8 [n, k] (int4 values for 4-bit)
    scale: torch.Tensor                      # [n, 1] or [n, k // g] (two-stage: s1 [n, 1])
    bias: torch.Tensor | None
    scale_second: torch.Tensor | None = None  # two-stage int4: s2 [n, k // g]
    input_scale: torch.Tensor | None = None  # static activations
    input_offset: torch.Tensor | None = None
    running: tuple[torch.Tensor, torch.Tensor] | None = None  # calibration: per-sample (scale, offset) [B, 1, 1]
    row_parallel: bool = False
    offset: torch.Tensor | None = None       # weight zero points (None: symmetric)
    error: float = 0.0                       # calibration: relative output error on calibration tokens
    clip_ratio: float | None = None          # calibration: mean AWQ clip ratio (None: no clip search)
    # calibration with the recipe's `tune`: the values [n, k] q was rounded from, in code units
    # (q = clamp(round(unrounded))); dropped once the layer is tuned
    unrounded: torch.Tensor | None = None

    def effective_scale(self) -> torch.Tensor:
        """The scale per weight group as calibration rounds with it (two-stage: s2 * s1; the NPU
        holds s1 in bf16, which `Scheme.served_weight` applies)."""
        if self.scale_second is not None:
            return self.scale_second * self.scale
        return self.scale

    def dequantized(self) -> torch.Tensor:
        return numerics.dequantize(self.q, self.effective_scale(), self.offset)

    @property
    def group_size(self) -> int:
        """0 for one scale per output channel, else the in-features per scale."""
        groups = self.effective_scale().shape[-1]
        return 0 if groups == 1 else self.q.shape[1] // groups

    def scale_rows(self, factor: torch.Tensor, rows: slice = slice(None)) -> None:
        """Output rows (`rows` of them) divided by `factor` after quantization (smoothing through this Linear)."""
        if rows != slice(None):
            full = torch.ones(self.q.shape[0], dtype=factor.dtype, device=factor.device)
            full[rows] = factor
            factor = full
        self.scale = self.scale / factor.unsqueeze(1)
        if self.bias is not None:
            self.bias = self.bias / factor


@dataclass
class PreparedLinear:
    """A Linear ready to run: its scheme, the backend and what the backend prepared from the
    checkpoint tensors. `linear(x, bias)` runs the scheme's kernel ops."""
    scheme: "Scheme"
    backend: object
    prepared: object
    n: int
    k: int
    group_size: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def build(cls, scheme: str, t: dict[str, torch.Tensor], *, backend, dtype: torch.dtype = torch.float32,
              add_quant_bias: bool = True) -> "PreparedLinear":
        """`t`: one Linear's tensors by suffix (`weight`, `weight_scale`, ...) as stored (deq_scale
        in either encoding, int4 packed [n/2, k]); `add_quant_bias=False` on tensor-parallel
        ranks > 0 of a row-parallel Linear (rank 0 adds it)."""
        from ascend_quant.schemes import SCHEMES

        s = SCHEMES.get(scheme)
        if s is None or not s.linear:
            known = ", ".join(n for n, x in SCHEMES.items() if x.linear)
            raise ValueError(f"scheme {scheme!r} is not a quantized Linear scheme ({known})")
        return s.prepare(t, backend, dtype, add_quant_bias)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.forward(self, x, bias)


class Scheme:
    """A scheme of the format. Subclasses (one file each) fill in the attributes and methods."""
    name: str = ""                   # as written in quant_model_description.json
    weight_bits: Optional[int] = None   # None: weights stay float
    weight_granularity: str = "none"    # "channel", "group" or "none"
    activation_bits: Optional[int] = None
    activation_mode: str = "none"       # "static" (per-tensor, calibrated), "dynamic" (per-token), "none"
    activation_symmetric: bool = True
    default_group_size: int = 0         # 0 = per-channel
    # calibration may write asymmetric weights (`weight_offset` zero points, `(w - offset) * scale`)
    weight_zero_points: bool = False
    kv_cache: bool = False              # a KV-cache scheme, not a Linear scheme
    linear: bool = False                # a quantized-Linear scheme (has tensor specs, pack, forward)
    served_by_vllm_ascend: str = ""     # what vllm-ascend 0.23 does with it (model card, inspect)
    cli_name: str = ""                  # `--scheme` spelling
    # the calibration recipe we recommend, as recipe-file keys (calibration/recipe.py builds
    # it; `group_size` defaults to `default_group_size`); the measurements are beside each
    preset: dict = {}
    # the higher-precision scheme a Linear group keeps under a quality budget (`calibrate
    # --max-ppl-increase`): W8A8_DYNAMIC for the 4-bit schemes (what msModelSlim's W4A8 and
    # W4A4 recipes fall back to), FLOAT for the 8-bit ones; "" where there is none
    fallback: str = ""

    def __repr__(self) -> str:
        return f"<scheme {self.name}>"

    @property
    def is_quantized(self) -> bool:
        return self.weight_bits is not None or self.kv_cache

    @property
    def weight_qmin(self) -> int:
        return numerics.qrange(self.weight_bits)[0]

    @property
    def weight_qmax(self) -> int:
        return numerics.qrange(self.weight_bits)[1]

    @property
    def packed(self) -> bool:
        """int4 weights travel two per byte, packed along n."""
        return self.weight_bits == 4

    # ------------------------------------------------------------------ checkpoint layout
    def tensor_specs(self, n: int, k: int, group_size: int = 0, *, two_stage: bool = False,
                     row_parallel: bool = False, tp_size: int = 1) -> dict[str, TensorSpec]:
        """The Linear's tensors besides an optional float `bias`."""
        raise NotImplementedError(self.name)

    def optional_suffixes(self) -> tuple[str, ...]:
        """Suffixes a checkpoint may carry for this scheme beyond `tensor_specs` (read if present)."""
        return ()

    def pack(self, ql: QuantizedLinear, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError(self.name)

    def unpack(self, t: dict[str, torch.Tensor], where: str = "") -> QuantizedLinear:
        """The QuantizedLinear a checkpoint's tensors (by suffix, as stored) stand for."""
        raise NotImplementedError(self.name)

    def layout_of(self, t_shapes: dict[str, tuple[int, ...]], group_size: int) -> tuple[int, bool]:
        """(group size, two-stage?) of a stored Linear from its tensors' shapes."""
        return 0, False

    def value_problems(self, name: str, read: Callable[[str], torch.Tensor]) -> list[str]:
        """Rules beyond `formats.checks` that a stored Linear `name` must meet to be served right."""
        return []

    def value_notes(self, name: str, read: Callable[[str], torch.Tensor]) -> list[str]:
        """What `verify` notes about a stored Linear `name` that is valid but not served everywhere
        (one line per kind, without the Linear's name: verify prints each once)."""
        return []

    def served_scale(self, ql: QuantizedLinear) -> torch.Tensor:
        """The float32 scale per weight group ([n, 1] or [n, k/g]) the kernels compute with."""
        return ql.effective_scale().float()

    def served_weight(self, ql: QuantizedLinear) -> torch.Tensor:
        """The float32 weight [n, k] the kernels compute with."""
        return numerics.dequantize(ql.q, self.served_scale(ql), ql.offset)

    def from_scale(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                   row_parallel: bool = False, **activation) -> QuantizedLinear:
        """The QuantizedLinear of integer weights `q` [n, k] served with `scale` ([n, 1] or
        [n, k/g]); `activation`: input_scale / input_offset for static activations."""
        if scale.shape[-1] != 1 and not self.group_size_for(q.shape[1] // scale.shape[-1]):
            raise SchemeError(f"{self.name} is per-channel only; per-group scales have no {self.name} form")
        return QuantizedLinear(self.name, q, scale, bias, row_parallel=row_parallel, **activation)

    def group_size_for(self, requested: int) -> int:
        """The group size calibration uses for a `--group-size` request (0: per-channel)."""
        return 0

    # ------------------------------------------------------------------ calibration
    def fake_quant_input(self, x: torch.Tensor, ql: QuantizedLinear | None, in_place: bool = False) -> torch.Tensor:
        """x as the scheme's Linears compute with it (quantized and dequantized)."""
        return x

    def fixed_scales(self, w: torch.Tensor, group_size: int, group_scale: Callable[[], torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(s1, s2) when the scheme fixes its weight scales before rounding (two-stage int4;
        `group_scale()` is the observer's per-group scale); None: the quantizer chooses them."""
        return None

    # ------------------------------------------------------------------ serving
    def prepare(self, t: dict[str, torch.Tensor], backend, dtype: torch.dtype = torch.float32,
                add_quant_bias: bool = True) -> PreparedLinear:
        raise NotImplementedError(self.name)

    def forward(self, linear: PreparedLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError(self.name)


def weight_values(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Integer weight values [n, k] from the stored `weight` (int4 unpacked)."""
    w = t["weight"].to(torch.int8)
    return numerics.unpack_int4(w) if bits == 4 else w


def stored_offset(t: dict[str, torch.Tensor], n: int, key: str = "weight_offset") -> torch.Tensor | None:
    """A stored zero point as float32 [n, groups], or None when absent or all zero."""
    off = t.get(key)
    return None if off is None or not bool(torch.any(off != 0)) else off.float().reshape(n, -1)


class WeightOnlyScheme(Scheme):
    """Integer weights, float activations: `x @ ((w - offset) * scale)^T` (W8A16, W4A16)."""
    linear = True
    scale_dtypes: tuple[torch.dtype, ...] = _F32

    def tensor_specs(self, n, k, group_size=0, *, two_stage=False, row_parallel=False, tp_size=1):
        groups = k // group_size if group_size else 1
        scale_kind = "group" if group_size else "channel"
        weight = (TensorSpec(torch.int8, (n // 2, k), "packed_weight") if self.packed
                  else TensorSpec(torch.int8, (n, k), "weight"))
        return {
            "weight": weight,
            "weight_scale": TensorSpec(torch.float32, (n, groups), scale_kind, self.scale_dtypes),
            "weight_offset": TensorSpec(torch.float32, (n, groups), scale_kind, self.scale_dtypes),
        }

    def layout_of(self, t_shapes, group_size):
        scale = t_shapes.get("weight_scale")
        groups = scale[-1] if scale and len(scale) == 2 else 1
        k = t_shapes["weight"][-1]
        return (0 if groups == 1 else k // groups if groups and k % groups == 0 else -1), False

    def pack(self, ql, model_dtype):
        scale = ql.scale.float()
        offset = ql.offset.float() if ql.offset is not None else torch.zeros_like(scale)
        return {"weight": numerics.pack_int4(ql.q) if self.packed else ql.q,
                "weight_scale": scale, "weight_offset": offset}

    def unpack(self, t, where=""):
        q = weight_values(t, self.weight_bits)
        n = q.shape[0]
        return QuantizedLinear(self.name, q, t["weight_scale"].float().reshape(n, -1), None,
                               offset=stored_offset(t, n))

    def prepare(self, t, backend, dtype=torch.float32, add_quant_bias=True):
        ql = self.unpack(t)
        n, k = ql.q.shape
        prepared = backend.prepare_weight_only(ql.q, ql.scale, ql.offset, self.weight_bits, dtype)
        return PreparedLinear(self, backend, prepared, n, k, group_size=ql.group_size)

    def forward(self, linear, x, bias):
        return linear.backend.weight_only_matmul(x, linear.prepared, bias=bias)
