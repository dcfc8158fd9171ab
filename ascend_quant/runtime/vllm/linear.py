"""vLLM linear methods for the Ascend schemes: declare the checkpoint tensors with vLLM's
parameter classes (so tensor-parallel sharding and q/k/v, gate/up fusion load them), then
hand the loaded shard to `runtime.qlinear.QuantLinear`, which calls the kernels.

Per partition (n = this rank's out-features, k = its in-features, g = group size):

| tensor | shape | vLLM parameter |
|---|---|---|
| weight (int8) | [n, k] | ModelWeightParameter |
| weight (int4 packed along n) | [n/2, k] | PackedvLLMParameter(packed_dim=0, factor 2) |
| input_scale, input_offset | [shards] | PerTensorScaleParameter (one per fused shard) |
| deq_scale (either encoding, decoded on load) | [n] float32 | ChannelQuantScaleParameter |
| quant_bias | [n] int32 | ChannelQuantScaleParameter (rank 0 adds it on row-parallel layers) |
| weight_scale, weight_offset | [n, 1] / [n, k/g] | ChannelQuantScaleParameter / GroupQuantScaleParameter |
| weight_scale_second, weight_offset_second | [n, k/g] | GroupQuantScaleParameter |
| scale_bias | [n, 1] / [n, 16/tp] (row-parallel) | ChannelQuantScaleParameter / GroupQuantScaleParameter |
| input_bias (a norm's smoothing bias) | [k] | BasevLLMParameter |
"""

from __future__ import annotations

import torch

from ascend_quant import numerics
from ascend_quant.runtime import kernels
from ascend_quant.runtime.vllm import ops
from ascend_quant.runtime.qlinear import LINEAR_SCHEMES, QuantLinear
from ascend_quant.schemes import SCHEMES

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    RowParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)

logger = init_logger(__name__)


def _decoding_loader(loader):
    """Wrap a weight loader so deq_scale arrives as float32 whichever encoding is stored."""
    def load(param, loaded_weight, *args, **kwargs):
        return loader(param, numerics.decode_deq_scale(loaded_weight), *args, **kwargs)
    return load


def refuse_bad_values(layer: torch.nn.Module, prefix: str, scheme: str, shards: list[str] | None = None) -> None:
    """The value rules `verify` applies (formats.checks: finite positive scales, finite floats),
    on the loaded parameters before any is used: a NaN or zero scale would otherwise serve NaN
    or noise with no error anywhere. One error naming the first bad tensor by its checkpoint
    name: a fused parameter (q/k/v, gate/up) is split back into its shards' rows first."""
    from ascend_quant.formats.checks import tensor_problems

    shards = shards or [prefix]
    widths = list(getattr(layer, "logical_widths", None) or [])
    for name, p in layer.named_parameters(recurse=False):
        data = p.data
        if len(shards) > 1 and data.dim() and data.shape[0] == len(shards):         # one value per shard
            parts = list(zip(shards, data.split(1)))
        elif len(shards) > 1 and len(widths) == len(shards) and data.dim() and data.shape[0] == sum(widths):
            parts = list(zip(shards, data.split(widths)))
        else:
            parts = [(prefix, data)]
        for shard, part in parts:
            problems = tensor_problems(f"{shard}.{name}", scheme, part)
            if problems:
                raise ValueError(problems[0])


def _add_norm_bias(layer: torch.nn.Module, input_size: int, weight_loader) -> None:
    layer.register_parameter("input_bias", BasevLLMParameter(
        data=torch.zeros(input_size, dtype=torch.float32), weight_loader=weight_loader))


@register_weight_loader_v2_supported_method
class AscendQuantLinearMethod(LinearMethodBase):
    """One Linear (or fused group) of a W8A8 / W8A8_DYNAMIC / W8A16 / W4A16 / W4A8_DYNAMIC scheme."""

    SCHEMES = LINEAR_SCHEMES

    def __init__(self, config, scheme: str, prefix: str, shards: list[str], norm_bias: str | None = None):
        self.config = config
        self.scheme = scheme
        self.prefix = prefix
        self.shards = shards
        self.norm_bias = norm_bias

    # ------------------------------------------------------------------ declare
    def _groups(self, k_total: int) -> tuple[int, bool]:
        """(group count along the full k, two-stage?) from the checkpoint header or group_size."""
        first = self.shards[0]
        two_stage = self.scheme == "W4A8_DYNAMIC" and (
            f"{first}.weight_scale_second" in self.config.description)
        if two_stage:
            groups = self.config.group_count(first, "weight_scale_second")
        elif self.scheme in ("W8A16", "W4A16"):
            groups = self.config.group_count(first)
        else:
            return 1, False
        if groups is None:            # no header (description passed in directly): use group_size
            g = int(self.config.meta.get("group_size") or 0)
            groups = k_total // g if g else 1
        return groups, two_stage

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        loader = extra_weight_attrs["weight_loader"]
        n, k = sum(output_partition_sizes), input_size_per_partition
        tp = getattr(layer, "tp_size", 1)
        row_parallel = isinstance(layer, RowParallelLinear)
        scheme = SCHEMES[self.scheme]
        layer.logical_widths = output_partition_sizes
        layer.ascend_scheme = self.scheme
        layer.ascend_row_parallel = row_parallel
        layer.ascend_op_key = ops.register_layer(layer, self.prefix)

        def reg(name, param):
            layer.register_parameter(name, param)

        if scheme.weight_bits == 4:
            if any(s % 2 for s in output_partition_sizes):
                raise ValueError(f"{self.prefix}: int4 weights pack two output channels per byte; "
                                 f"shard sizes {output_partition_sizes} are not all even")
            reg("weight", PackedvLLMParameter(data=torch.empty(n // 2, k, dtype=torch.int8), input_dim=1,
                                              output_dim=0, packed_dim=0, packed_factor=2, weight_loader=loader))
        else:
            reg("weight", ModelWeightParameter(data=torch.empty(n, k, dtype=torch.int8), input_dim=1,
                                               output_dim=0, weight_loader=loader))

        if self.scheme == "W8A8":
            shards = len(output_partition_sizes)
            for name in ("input_scale", "input_offset"):
                reg(name, PerTensorScaleParameter(data=torch.empty(shards, dtype=torch.float32), weight_loader=loader))
            reg("deq_scale", ChannelQuantScaleParameter(data=torch.empty(n, dtype=torch.float32), output_dim=0,
                                                        weight_loader=_decoding_loader(loader)))
            reg("quant_bias", ChannelQuantScaleParameter(data=torch.empty(n, dtype=torch.int32), output_dim=0,
                                                         weight_loader=loader))
        else:
            groups, two_stage = self._groups(input_size)
            per_group = groups > 1 and not two_stage
            for name in ("weight_scale", "weight_offset"):
                if per_group:
                    if (input_size // groups) == 0 or k % (input_size // groups):
                        raise ValueError(f"{self.prefix}: group size {input_size // groups} does not divide this "
                                         f"rank's {k} in-features")
                    reg(name, GroupQuantScaleParameter(data=torch.empty(n, k * groups // input_size,
                                                                        dtype=torch.float32),
                                                       input_dim=1, output_dim=0, weight_loader=loader))
                else:
                    reg(name, ChannelQuantScaleParameter(data=torch.empty(n, 1, dtype=torch.float32),
                                                         output_dim=0, weight_loader=loader))
            if two_stage:
                g = input_size // groups
                if k % g:
                    raise ValueError(f"{self.prefix}: group size {g} does not divide this rank's {k} in-features")
                for name in ("weight_scale_second", "weight_offset_second"):
                    reg(name, GroupQuantScaleParameter(data=torch.empty(n, k // g, dtype=torch.float32),
                                                       input_dim=1, output_dim=0, weight_loader=loader))
            if self.scheme == "W4A8_DYNAMIC":
                if row_parallel:
                    chunks = numerics.scale_bias_chunks(True)
                    if chunks % tp:
                        raise ValueError(f"{self.prefix}: scale_bias has {chunks} chunks, not divisible by "
                                         f"tensor-parallel size {tp}")
                    reg("scale_bias", GroupQuantScaleParameter(data=torch.empty(n, chunks // tp, dtype=torch.float32),
                                                               input_dim=1, output_dim=0, weight_loader=loader))
                else:
                    reg("scale_bias", ChannelQuantScaleParameter(data=torch.empty(n, 1, dtype=torch.float32),
                                                                 output_dim=0, weight_loader=loader))
        if self.norm_bias:
            _add_norm_bias(layer, k, loader)

    # ------------------------------------------------------------------ after loading
    def process_weights_after_loading(self, layer) -> None:
        t = {name: p.data for name, p in layer.named_parameters(recurse=False)
             if name not in ("bias", "input_bias")}
        refuse_bad_values(layer, self.prefix, self.scheme, self.shards)
        if self.scheme == "W8A8":
            for name in ("input_scale", "input_offset"):
                values = t[name].reshape(-1)
                if not torch.all(values == values[-1]):
                    logger.warning("%s: fused shards have different %s %s; using the last one, as vllm-ascend "
                                   "does (calibrate them on the shared input)", self.prefix, name, values.tolist())
        add_quant_bias = not (layer.ascend_row_parallel and getattr(layer, "tp_rank", 0) > 0)
        device = layer.weight.device
        b = kernels.get_backend(device, "linear", n=layer.weight.shape[0], k=layer.weight.shape[1],
                                bits=SCHEMES[self.scheme].weight_bits)
        layer.ascend_qlinear = QuantLinear.build(self.scheme, t, backend=b, dtype=layer.params_dtype,
                                                 add_quant_bias=add_quant_bias)
        # the kernel keeps what it needs in its own layout: drop the loaded copies, so that
        # serving memory is that of the prepared weights alone
        for name, param in layer.named_parameters(recurse=False):
            if name in t:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if hasattr(layer, "input_bias"):
            layer.input_bias_cast = layer.input_bias.data.to(layer.params_dtype)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_bias:
            x = x + layer.input_bias_cast
        # one opaque custom op: vLLM's compiled mode must not trace into the kernels
        return torch.ops.ascend_quant.linear(x, bias, layer.ascend_op_key, layer.ascend_qlinear.n)


@register_weight_loader_v2_supported_method
class AscendQuantFloatLinearMethod(UnquantizedLinearMethod):
    """A FLOAT Linear: its loaded values are checked (finite), and an input norm's smoothing
    bias, if the checkpoint has one, is added to its input."""

    def __init__(self, prefix: str, norm_bias: str | None = None):
        super().__init__()
        self.prefix = prefix
        self.norm_bias = norm_bias

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                               output_size, params_dtype, **extra_weight_attrs)
        if self.norm_bias:
            _add_norm_bias(layer, input_size_per_partition, extra_weight_attrs["weight_loader"])

    def process_weights_after_loading(self, layer) -> None:
        refuse_bad_values(layer, self.prefix, "FLOAT")
        super().process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        if self.norm_bias:
            x = x + layer.input_bias.to(x.dtype)
        return super().apply(layer, x, bias)
