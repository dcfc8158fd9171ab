"""vLLM linear methods for the Ascend schemes: declare the checkpoint tensors with vLLM's
parameter classes (so tensor-parallel sharding and q/k/v, gate/up fusion load them), then
hand the loaded shard to its scheme (`ascend_quant.schemes`), which calls the kernels.

Each scheme's `tensor_specs` gives its tensors per partition (n = this rank's out-features,
k = its in-features) with a parameter kind, mapped here to vLLM's classes:

| kind | vLLM parameter |
|---|---|
| weight (int8 [n, k]) | ModelWeightParameter |
| packed_weight (int4 pairs along n, [n/2, k]) | PackedvLLMParameter(packed_dim=0, factor 2) |
| per_shard (static input_scale / input_offset) | PerTensorScaleParameter (one per fused shard) |
| channel ([n] or [n, 1]) | ChannelQuantScaleParameter |
| group ([n, k/g]) | GroupQuantScaleParameter |
| input_bias (a norm's smoothing bias, [k]) | BasevLLMParameter |
| input_rotation (an online rotation's signs, [k]) | BasevLLMParameter (not split: tensor parallel 1) |

A spec's `on_load` (deq_scale: either stored encoding to float32) wraps the weight loader.
"""

from __future__ import annotations

import os

import torch

from ascend_quant import numerics
from ascend_quant.runtime import kernels
from ascend_quant.runtime.kernels import cpu as cpu_kernels
from ascend_quant.runtime.vllm import ops
from ascend_quant.schemes import FLOAT, INPUT_ROTATION, LINEAR_SCHEMES, SCHEMES, PreparedLinear, SchemeError, TensorSpec

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

# "0": compiled mode calls every quantized Linear through the opaque `ascend_quant::linear` op,
# also those whose backend could be traced (CpuBackend.traceable)
TRACE_ENV = "ASCEND_QUANT_VLLM_TRACE"


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


def _add_input_rotation(layer: torch.nn.Module, input_size: int, weight_loader) -> None:
    """The `input_rotation` signs [k] of an online input rotation (numerics.input_rotation); the
    full k on every rank, so a row-parallel Linear split across ranks is refused."""
    if getattr(layer, "tp_size", 1) > 1 and isinstance(layer, RowParallelLinear):
        raise ValueError("an online input rotation (input_rotation) spans all in-features; serve this checkpoint "
                         "with tensor_parallel_size 1")
    layer.register_parameter(INPUT_ROTATION, BasevLLMParameter(
        data=torch.empty(input_size, dtype=torch.float32), weight_loader=weight_loader))


def _prepare_input_rotation(layer: torch.nn.Module) -> None:
    """What `_rotate` needs, from the loaded signs, which `refuse_bad_values` has checked; the
    parameter is emptied. On the CPU our C++ operator (`ascend_quant_cpu::hadamard`: butterflies)
    where it loads, with the signs and H's Paley core; elsewhere the signs and H's Kronecker
    factors (float32) for numerics.rotate_activation."""
    signs = getattr(layer, INPUT_ROTATION).data.float()
    op = cpu_kernels.hadamard_op() if signs.device.type == "cpu" else None
    layer.ascend_input_signs = signs
    layer.ascend_hadamard_isa = None if op is None else op[1]
    if op is not None:
        core, _ = numerics.hadamard_parts(signs.numel())
        layer.ascend_input_core = core.float().contiguous()
    else:
        layer.ascend_input_factors = tuple(f.float().to(signs.device) for f in numerics.rotation_factors(signs.numel()))
    getattr(layer, INPUT_ROTATION).data = torch.empty(0)


def _rotate(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x·Q computed in float32, in x's dtype: one operator call on the CPU, else
    numerics.rotate_activation (torch ops, traced when compiled)."""
    if layer.ascend_hadamard_isa is not None:
        return torch.ops.ascend_quant_cpu.hadamard(x, layer.ascend_input_signs, layer.ascend_input_core,
                                                    layer.ascend_hadamard_isa)
    return numerics.rotate_activation(x.float(), layer.ascend_input_signs, layer.ascend_input_factors).to(x.dtype)


def _vllm_parameter(spec: TensorSpec, shards: int, loader):
    """The vLLM parameter class that shards a scheme tensor of this kind (schemes.PARAM_KINDS)."""
    if spec.on_load is not None:
        inner, on_load = loader, spec.on_load
        loader = lambda param, w, *a, **kw: inner(param, on_load(w), *a, **kw)  # noqa: E731
    if spec.param == "per_shard":
        return PerTensorScaleParameter(data=torch.empty(shards, dtype=spec.dtype), weight_loader=loader)
    data = torch.empty(spec.shape, dtype=spec.dtype)
    if spec.param == "weight":
        return ModelWeightParameter(data=data, input_dim=1, output_dim=0, weight_loader=loader)
    if spec.param == "packed_weight":
        return PackedvLLMParameter(data=data, input_dim=1, output_dim=0, packed_dim=0, packed_factor=2,
                                   weight_loader=loader)
    if spec.param == "channel":
        return ChannelQuantScaleParameter(data=data, output_dim=0, weight_loader=loader)
    if spec.param == "group":
        return GroupQuantScaleParameter(data=data, input_dim=1, output_dim=0, weight_loader=loader)
    raise AssertionError(spec.param)


@register_weight_loader_v2_supported_method
class AscendQuantLinearMethod(LinearMethodBase):
    """One Linear (or fused group) of a quantized-Linear scheme: its tensors are declared from
    the scheme's `tensor_specs` and served by the scheme's `prepare` / `forward`."""

    SCHEMES = LINEAR_SCHEMES

    def __init__(self, config, scheme: str, prefix: str, shards: list[str], norm_bias: str | None = None,
                 input_rotation: bool = False):
        self.config = config
        self.scheme = scheme
        self.prefix = prefix
        self.shards = shards
        self.norm_bias = norm_bias
        self.input_rotation = input_rotation

    # ------------------------------------------------------------------ declare
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

        if scheme.packed and any(s % 2 for s in output_partition_sizes):
            raise ValueError(f"{self.prefix}: int4 weights pack two output channels per byte; "
                             f"shard sizes {output_partition_sizes} are not all even")
        group_size, two_stage = self.config.layout(self.shards[0], self.scheme)
        if group_size and k % group_size:
            raise ValueError(f"{self.prefix}: group size {group_size} does not divide this rank's {k} in-features")
        try:
            specs = scheme.tensor_specs(n, k, group_size, two_stage=two_stage, row_parallel=row_parallel, tp_size=tp)
        except SchemeError as e:
            raise ValueError(f"{self.prefix}: {e}") from None
        for name, spec in specs.items():
            layer.register_parameter(name, _vllm_parameter(spec, len(output_partition_sizes), loader))
        if self.norm_bias:
            _add_norm_bias(layer, k, loader)
        if self.input_rotation:
            _add_input_rotation(layer, k, loader)

    # ------------------------------------------------------------------ after loading
    def process_weights_after_loading(self, layer) -> None:
        refuse_bad_values(layer, self.prefix, self.scheme, self.shards)
        if self.input_rotation:
            _prepare_input_rotation(layer)
        t = {name: p.data for name, p in layer.named_parameters(recurse=False)
             if name not in ("bias", "input_bias", INPUT_ROTATION)}
        for name, param in layer.named_parameters(recurse=False):
            if isinstance(param, PerTensorScaleParameter):
                values = t[name].reshape(-1)
                if not torch.all(values == values[-1]):
                    logger.warning("%s: fused shards have different %s %s; using the last one, as vllm-ascend "
                                   "does (calibrate them on the shared input)", self.prefix, name, values.tolist())
        add_quant_bias = not (layer.ascend_row_parallel and getattr(layer, "tp_rank", 0) > 0)
        device = layer.weight.device
        b = kernels.get_backend(device, "linear", n=layer.weight.shape[0], k=layer.weight.shape[1],
                                bits=SCHEMES[self.scheme].weight_bits)
        layer.ascend_qlinear = PreparedLinear.build(self.scheme, t, backend=b, dtype=layer.params_dtype,
                                                 add_quant_bias=add_quant_bias)
        # the output dtype and the bias are fixed now: a backend may keep one layout only
        finalize = getattr(b, "finalize_linear", None)
        if finalize is not None:
            finalize(layer.ascend_qlinear, layer.params_dtype, getattr(layer, "bias", None) is not None)
        # the kernel keeps what it needs in its own layout: drop the loaded copies, so that
        # serving memory is that of the prepared weights alone
        for name, param in layer.named_parameters(recurse=False):
            if name in t:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if hasattr(layer, "input_bias"):
            layer.input_bias_cast = layer.input_bias.data.to(layer.params_dtype)
        # compiled mode traces the forward where the backend says it is torch ops only; the
        # switch forces the opaque op everywhere (to compare, or if a trace misbehaves)
        traceable = getattr(b, "traceable", None)
        layer.ascend_traceable = (os.environ.get(TRACE_ENV, "1") != "0"
                                  and bool(traceable and traceable(layer.ascend_qlinear)))

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_bias:
            x = x + layer.input_bias_cast
        if self.input_rotation:
            x = _rotate(layer, x)
        if torch.compiler.is_compiling() and not layer.ascend_traceable:
            # one opaque custom op: vLLM's compiled mode must not trace into the kernels, unless
            # the backend says they are torch ops only (CpuBackend.traceable)
            return torch.ops.ascend_quant.linear(x, bias, layer.ascend_op_key, layer.ascend_qlinear.n)
        # eager: the same forward without the op's dispatch and forward-context lookup
        # (measured ~10 us a call, a few percent of a small model's decode step)
        return layer.ascend_qlinear(x, bias)


@register_weight_loader_v2_supported_method
class AscendQuantFloatLinearMethod(UnquantizedLinearMethod):
    """A FLOAT Linear: its loaded values are checked (finite), and an input norm's smoothing
    bias, if the checkpoint has one, is added to its input."""

    def __init__(self, prefix: str, norm_bias: str | None = None, input_rotation: bool = False):
        super().__init__()
        self.prefix = prefix
        self.norm_bias = norm_bias
        self.input_rotation = input_rotation

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                               output_size, params_dtype, **extra_weight_attrs)
        if self.norm_bias:
            _add_norm_bias(layer, input_size_per_partition, extra_weight_attrs["weight_loader"])
        if self.input_rotation:
            _add_input_rotation(layer, input_size_per_partition, extra_weight_attrs["weight_loader"])

    def process_weights_after_loading(self, layer) -> None:
        refuse_bad_values(layer, self.prefix, FLOAT.name)
        if self.input_rotation:
            _prepare_input_rotation(layer)
        super().process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        if self.norm_bias:
            x = x + layer.input_bias.to(x.dtype)
        if self.input_rotation:
            x = _rotate(layer, x)
        return super().apply(layer, x, bias)
