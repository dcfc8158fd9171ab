"""Mixture-of-Experts layers: which layers are MoE, the per-expert Linear groups, and the
per-expert module that calibration and the reference model run instead of transformers'
fused experts.

    x -> post_attention_layernorm -> router (FLOAT) -> top-k experts e, weights w
                                  -> expert e: down(silu(gate(x)) * up(x)) -> sum_k w_k * y_e
                                  -> shared expert (Qwen2-MoE, scaled by sigmoid(shared_expert_gate))

transformers 5 keeps the routed experts fused as 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]); the checkpoint and vLLM
name them per expert (`experts.E.gate_proj.weight`, Mixtral `experts.E.w1.weight`).
`LinearExperts` holds one Linear per expert and name and computes what the fused module's
eager loop computes, with the router's choice passed in: so per-Linear hooks see each
expert's routed tokens, and the state-dict names are the checkpoint's.

Smoothing: post_attention_layernorm also feeds the router and the shared expert, so nothing
folds into it from the experts (their gate/up group has no producer); up -> down inside one
expert is an equivalence (the down group's producer is that expert's up).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from ascend_quant.arch.spec import LinearGroup, config_get


@dataclass(frozen=True)
class MoESpec:
    """Where a family's MoE block sits and how its layers are chosen (paths relative to the
    decoder layer, as transformers names the modules)."""
    num_experts_keys: tuple[str, ...]         # config keys for the number of routed experts (first found)
    linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")   # one expert's gate, up, down
    block: str = "mlp"                        # the sparse MoE block
    disk_block: str | None = None             # the block's name on disk when it differs (Mixtral)
    experts: str = "experts"                  # relative to the block
    router: str = "gate"                      # relative to the block; FLOAT, `.weight` [E, H]
    float_modules: tuple[str, ...] = ()       # other modules kept FLOAT (shared-expert gate)
    # the router's tensors besides its weight, FLOAT and required (DeepSeek-V3's persistent
    # buffer `e_score_correction_bias`, a float32 parameter in vLLM)
    router_tensors: tuple[str, ...] = ()
    shared_groups: tuple[LinearGroup, ...] = ()   # shared experts: ordinary Linears
    replaces: tuple[str, ...] = ("gate_up", "down")   # the dense groups a MoE layer has not
    # which layers are MoE: all, but those listed under `dense_layers_key`, those before
    # `first_dense_key`, and those where (i + 1) % `sparse_step_key` is not 0
    dense_layers_key: str | None = None
    sparse_step_key: str | None = None
    first_dense_key: str | None = None
    vllm_ascend_maps: bool = True             # vllm-ascend 0.23 has an `experts` mapping for it

    # ------------------------------------------------------------------ layers
    def num_experts(self, config) -> int:
        return int(next((v for k in self.num_experts_keys if (v := config_get(config, k))), 0) or 0)

    def is_moe_layer(self, index: int, config) -> bool:
        if self.num_experts(config) <= 0:
            return False
        if self.dense_layers_key and index in (config_get(config, self.dense_layers_key) or ()):
            return False
        if self.first_dense_key and index < int(config_get(config, self.first_dense_key) or 0):
            return False
        step = int(config_get(config, self.sparse_step_key) or 1) if self.sparse_step_key else 1
        return (index + 1) % step == 0

    # ------------------------------------------------------------------ names
    @property
    def experts_path(self) -> str:
        return f"{self.block}.{self.experts}"

    @property
    def router_path(self) -> str:
        return f"{self.block}.{self.router}"

    def expert_linear(self, e: int | str, role: int) -> str:
        """Expert `e`'s gate (role 0), up (1) or down (2) Linear, relative to the layer."""
        return f"{self.experts_path}.{e}.{self.linears[role]}"

    @property
    def groups(self) -> tuple[LinearGroup, ...]:
        """One expert's gate/up and down groups, names templated on `{e}`."""
        g, u, d = (self.expert_linear("{e}", r) for r in range(3))
        return (LinearGroup("gate_up", (g, u)),
                LinearGroup("down", (d,), u, "linear_rows", row_parallel=True))

    def layer_groups(self, dense: tuple[LinearGroup, ...], num_experts: int) -> tuple[LinearGroup, ...]:
        kept = tuple(g for g in dense if g.name not in self.replaces)
        experts = tuple(replace(g, linears=tuple(n.format(e=e) for n in g.linears),
                                producer=g.producer and g.producer.format(e=e), expert=e)
                        for e in range(num_experts) for g in self.groups)
        return kept + self.shared_groups + experts

    def template(self, rel: str) -> str:
        """`mlp.experts.{e}.down_proj` for `mlp.experts.3.down_proj` (others unchanged)."""
        return re.sub(rf"^{re.escape(self.experts_path)}\.\d+\.", f"{self.experts_path}.{{e}}.", rel)

    def expert_of(self, rel: str) -> int | None:
        m = re.match(rf"^{re.escape(self.experts_path)}\.(\d+)\.", rel)
        return int(m.group(1)) if m else None

    def to_disk(self, name: str) -> str:
        if not self.disk_block:
            return name
        return re.sub(rf"(\.layers\.\d+\.){re.escape(self.block)}\.", rf"\g<1>{self.disk_block}.", name)

    def from_disk(self, name: str) -> str:
        if not self.disk_block:
            return name
        return re.sub(rf"(\.layers\.\d+\.){re.escape(self.disk_block)}\.", rf"\g<1>{self.block}.", name)

    def from_disk_relative(self, rel: str) -> str:
        if self.disk_block and rel.startswith(self.disk_block + "."):
            return self.block + rel[len(self.disk_block):]
        return rel


class Expert(nn.Module):
    """One routed expert: `down(act(gate(x)) * up(x))` with its Linears under the checkpoint's names."""

    def __init__(self, names: tuple[str, str, str], hidden: int, intermediate: int, act_fn, device=None, dtype=None):
        super().__init__()
        self.names = names
        kw = dict(bias=False, device=device, dtype=dtype)
        setattr(self, names[0], nn.Linear(hidden, intermediate, **kw))
        setattr(self, names[1], nn.Linear(hidden, intermediate, **kw))
        setattr(self, names[2], nn.Linear(intermediate, hidden, **kw))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class LinearExperts(nn.ModuleList):
    """The routed experts as per-expert Linears, called like transformers' fused experts:
    `(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`.

    Calibration sets `token_mask` ([T] bool, False for padding): each expert then records
    `routed_valid` (the mask of the tokens it is handed) and `counts[e]` (its real routed
    tokens). With `all_tokens` every expert is run on every token (for statistics only) and
    only its routed rows enter the sum, so the output is the routed one either way."""

    def __init__(self, experts: list[Expert]):
        super().__init__(experts)
        self.token_mask: torch.Tensor | None = None
        self.all_tokens = False
        self.routed_valid: torch.Tensor | None = None
        self.counts: dict[int, int] = {}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        num = len(self)
        for e in range(num):
            top_k_pos, token_idx = torch.where(top_k_index.t() == e)
            routed = token_idx.numel() > 0
            if self.token_mask is not None:
                self.counts[e] = int(self.token_mask[token_idx].sum())
            if not routed and not self.all_tokens:
                continue
            if self.all_tokens:
                self.routed_valid = self.token_mask
                y = self[e](hidden_states.clone())[token_idx]
            else:
                self.routed_valid = None if self.token_mask is None else self.token_mask[token_idx]
                y = self[e](hidden_states[token_idx])
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        self.routed_valid = None
        return out


def _fused_shapes(experts: nn.Module) -> tuple[int, int, int]:
    """(E, H, I) of transformers' fused experts (`gate_up_proj` [E, 2I, H])."""
    e, two_i, h = experts.gate_up_proj.shape
    return e, h, two_i // 2


def linear_experts_from_fused(experts: nn.Module, names: tuple[str, str, str]) -> LinearExperts:
    """Per-expert Linears holding the fused module's weights (on the meta device if they are)."""
    num, hidden, inter = _fused_shapes(experts)
    gu, down = experts.gate_up_proj, experts.down_proj
    meta = gu.is_meta
    out = LinearExperts([Expert(names, hidden, inter, experts.act_fn, device="meta" if meta else gu.device,
                                dtype=gu.dtype) for _ in range(num)])
    if not meta:
        with torch.no_grad():
            for e, expert in enumerate(out):
                getattr(expert, names[0]).weight.copy_(gu[e, :inter])
                getattr(expert, names[1]).weight.copy_(gu[e, inter:])
                getattr(expert, names[2]).weight.copy_(down[e])
    return out


def replace_experts(model: nn.Module, spec) -> None:
    """Swap every MoE layer's fused experts for `LinearExperts` (in place; already swapped
    layers are left as they are)."""
    moe = spec.moe
    if moe is None:
        return
    for i, layer in enumerate(spec.layers(model)):
        if not spec.is_moe_layer(i, model.config):
            continue
        block = layer.get_submodule(moe.block)
        experts = getattr(block, moe.experts)
        if isinstance(experts, LinearExperts):
            continue
        if not hasattr(experts, "gate_up_proj"):
            raise ValueError(f"{spec.layers_path}.{i}.{moe.experts_path}: no fused gate_up_proj to split "
                             f"({type(experts).__name__})")
        setattr(block, moe.experts, linear_experts_from_fused(experts, moe.linears))


def experts_of(layer: nn.Module, spec) -> LinearExperts | None:
    """The layer's `LinearExperts`, or None (a dense layer, or not swapped)."""
    if spec.moe is None:
        return None
    try:
        m = layer.get_submodule(spec.moe.experts_path)
    except AttributeError:
        return None
    return m if isinstance(m, LinearExperts) else None
