"""vLLM's routed experts (`RoutedExperts`, vLLM 0.32) for quantized Ascend experts.

The checkpoint stores each expert as three ordinary Linears (`experts.E.gate_proj`, `up_proj`,
`down_proj`, or Mixtral's `w1`, `w3`, `w2`) with the dense tensors of their scheme. vLLM's
expert loader maps them onto stacked parameters: `gate_proj.<suffix>` and `up_proj.<suffix>`
into the first and second half of `w13_<suffix>` [E, 2I, ...], `down_proj.<suffix>` into
`w2_<suffix>` [E, H, ...]; tensor parallelism narrows w13 along its rows and w2 along its
in-features (or its scale_bias chunks). `create_weights` declares one such parameter per
suffix of the scheme's `tensor_specs` (w13 as a column-parallel Linear of 2I out-features,
w2 as a row-parallel one of H), with the `quant_method` ("channel" / "group") the loader
branches on.

After loading, every expert becomes two `schemes.PreparedLinear` (w13, w2) built by the
scheme's `prepare` on the kernel backend (which may group them into one kernel object,
`backend.group_experts`: the cpu backend's VNNI kernel for int8 activations), and `apply` hands the routed tokens to
`kernels.moe.routed_experts` through the one custom op `ascend_quant::moe` (runtime.vllm.ops),
so compiled mode traces around it.

Grouped top-k routing (DeepSeek's `use_grouped_topk`, with `e_score_correction_bias`) runs
inside our op instead (`ascend_quant::moe_routed`, the method reports itself monolithic and
gets the router logits): in vLLM 0.32's compiled mode on the CPU the traced routing of a
DeepSeek-V3 layer (sigmoid scores) picked other experts than in eager mode whenever our
Linears were in the graph, and was right once the logits reached it through an opaque op.
The routing itself is vLLM's (`cpu_router.select_experts`, as vLLM's own monolithic CPU experts
use), on the layer's routing settings.

Not served: static-activation (W8A8) experts, whose one input scale per expert has no
vLLM parameter kind here (vllm-ascend 0.23 refuses them too); expert parallelism; activations
other than SiLU-gated; router weights applied on the input.
"""

from __future__ import annotations

import torch

from ascend_quant.runtime import kernels
from ascend_quant.runtime.vllm import ops
from ascend_quant.schemes import SCHEMES, PreparedLinear, SchemeError

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

logger = init_logger("vllm.ascend_quant.moe")

# scheme tensor kinds -> the `quant_method` attribute vLLM's expert loader reads on scales
_LOADER_KIND = {"channel": "channel", "group": "group"}


def expert_names(layer) -> tuple[str, str, str]:
    """The checkpoint names of an expert's gate, up and down projections, as vLLM's layer knows them."""
    return layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name


class AscendQuantMoEMethod(FusedMoEMethodBase):
    """Routed experts of one quantized-Linear scheme, served by that scheme's kernels."""

    def __init__(self, config, scheme: str, prefix: str, moe_config, names: tuple[str, str, str],
                 route_inside: bool = False):
        super().__init__(moe_config)
        self.config = config
        self.scheme = scheme
        self.prefix = prefix
        self.names = names          # gate, up, down
        self.specs: dict[str, dict] = {}
        self.route_inside = route_inside

    @property
    def is_monolithic(self) -> bool:
        return self.route_inside

    # ------------------------------------------------------------------ declare
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        moe = self.moe
        if moe.use_ep:
            raise NotImplementedError(f"{self.prefix}: expert parallelism is not supported by ascend-quant's "
                                      "MoE method (use tensor parallelism)")
        if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
            raise NotImplementedError(f"{self.prefix}: ascend-quant's experts compute silu(gate) * up; "
                                      f"this model uses {moe.activation.value!r}")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(f"{self.prefix}: router weights applied on the input are not supported")
        scheme = SCHEMES[self.scheme]
        n13, h, i = 2 * intermediate_size_per_partition, hidden_size, intermediate_size_per_partition
        if scheme.packed and i % 2:
            raise ValueError(f"{self.prefix}: int4 experts pack two output channels per byte; "
                             f"this rank's {i} intermediate channels are odd")
        group_size, two_stage = self.config.layout(f"{self.prefix}.0.{self.names[0]}", self.scheme)
        for k in (h, i):
            if group_size and k % group_size:
                raise ValueError(f"{self.prefix}: group size {group_size} does not divide this rank's {k} in-features")
        try:
            self.specs = {
                "w13": scheme.tensor_specs(n13, h, group_size, two_stage=two_stage, row_parallel=False,
                                           tp_size=moe.tp_size),
                "w2": scheme.tensor_specs(h, i, group_size, two_stage=two_stage, row_parallel=True,
                                          tp_size=moe.tp_size),
            }
        except SchemeError as e:
            raise ValueError(f"{self.prefix}: {e}") from None
        loader = extra_weight_attrs["weight_loader"]
        for stem, specs in self.specs.items():
            for suffix, spec in specs.items():
                if spec.param not in ("weight", "packed_weight", *_LOADER_KIND):
                    raise NotImplementedError(
                        f"{self.prefix}: {self.scheme} experts are not served ({suffix} is one value per "
                        "expert and Linear; vllm-ascend 0.23 refuses them too): use W8A8_DYNAMIC or W4A8_DYNAMIC")
                p = torch.nn.Parameter(torch.empty((num_experts, *spec.shape), dtype=spec.dtype),
                                       requires_grad=False)
                attrs = {"weight_loader": self._loader(loader, stem, suffix, spec)}
                if spec.param in _LOADER_KIND:
                    attrs["quant_method"] = _LOADER_KIND[spec.param]
                set_weight_attrs(p, attrs)
                layer.register_parameter(f"{stem}_{suffix}", p)
        layer.ascend_scheme = self.scheme
        layer.ascend_op_key = ops.register_layer(layer, self.prefix)

    def _loader(self, loader, stem: str, suffix: str, spec):
        """vLLM's expert loader, with the stored encoding decoded (`on_load`) and, for w2's
        chunked `scale_bias` [H, chunks], this rank's chunks taken first: the loader sends any
        name with "bias" in it down its bias branch, which copies w2 biases whole."""
        on_load = spec.on_load
        chunked = stem == "w2" and "bias" in suffix and spec.param == "group"
        moe = self.moe
        if on_load is None and not (chunked and moe.tp_size > 1):
            return loader

        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            if on_load is not None:
                loaded_weight = on_load(loaded_weight)
            if chunked and moe.tp_size > 1:
                per_rank = param.shape[-1]
                loaded_weight = loaded_weight.narrow(-1, moe.tp_rank * per_rank, per_rank)
            return loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=return_success)

        load.supports_moe_loading = True
        return load

    def get_fused_moe_quant_config(self, layer):
        return None         # no vLLM modular kernel: apply runs ours

    # ------------------------------------------------------------------ after loading
    def _refuse_bad_values(self, layer) -> None:
        """The value rules of `verify` (finite, positive scales) on every loaded expert tensor,
        naming the first bad one by its checkpoint key (w13's rows split back into gate and up)."""
        from ascend_quant.formats.checks import tensor_problems

        gate, up, down = self.names
        for stem, specs in self.specs.items():
            for suffix in specs:
                data = getattr(layer, f"{stem}_{suffix}").data
                if not tensor_problems(f"{self.prefix}.{stem}_{suffix}", self.scheme, data):
                    continue
                for e in range(data.shape[0]):
                    parts = (zip((gate, up), data[e].chunk(2, dim=0)) if stem == "w13" else [(down, data[e])])
                    for name, part in parts:
                        problems = tensor_problems(f"{self.prefix}.{e}.{name}.{suffix}", self.scheme, part)
                        if problems:
                            raise ValueError(problems[0])

    def process_weights_after_loading(self, layer) -> None:
        self._refuse_bad_values(layer)
        scheme = SCHEMES[self.scheme]
        t = {stem: {suffix: getattr(layer, f"{stem}_{suffix}").data for suffix in specs}
             for stem, specs in self.specs.items()}
        device = t["w13"]["weight"].device
        backend = kernels.get_backend(device, "linear", n=t["w13"]["weight"].shape[1],
                                      k=t["w13"]["weight"].shape[2], bits=scheme.weight_bits)
        first_rank = self.moe.tp_rank == 0
        experts = []
        for e in range(t["w13"]["weight"].shape[0]):
            w13 = PreparedLinear.build(self.scheme, {s: x[e] for s, x in t["w13"].items()}, backend=backend,
                                       dtype=layer.params_dtype)
            w2 = PreparedLinear.build(self.scheme, {s: x[e] for s, x in t["w2"].items()}, backend=backend,
                                      dtype=layer.params_dtype, add_quant_bias=first_rank)
            experts.append((w13, w2))
        # one kernel for all experts where the backend has it (cpu: AVX-512 VNNI), else the list
        layer.ascend_experts = backend.group_experts(experts, layer.params_dtype) or experts
        # the prepared experts hold what the kernels need: drop the loaded copies
        for stem, specs in self.specs.items():
            for suffix in specs:
                p = getattr(layer, f"{stem}_{suffix}")
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return torch.ops.ascend_quant.moe(x, topk_weights, topk_ids, layer.ascend_op_key)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        return torch.ops.ascend_quant.moe_routed(x, router_logits, layer.ascend_op_key)


def select_experts(layer, x: torch.Tensor, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU routing on the routing settings of `layer` (a RoutedExperts): top-k weights
    (already scaled by the router's routed_scaling_factor) and expert ids."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts as vllm_select

    return vllm_select(x, router_logits, layer.top_k, layer.use_grouped_topk, layer.renormalize,
                       topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
                       custom_routing_function=layer.custom_routing_function, scoring_func=layer.scoring_func,
                       routed_scaling_factor=layer.routed_scaling_factor,
                       e_score_correction_bias=layer.e_score_correction_bias)
