"""What an architecture spec says: the decoder layers, the Linear groups that share an input,
the producer of that input, and the names vLLM and the checkpoint use for them.

Everything that depends on a model family is here as data, plus the few functions that read
it. Calibration, the writer, verify, inspect, convert, the reference model and the vLLM config
ask a spec; none of them names a module.

A group is a set of Linears that read the same tensor. Its producer is the module whose output
that tensor is, and its kind says how a SmoothQuant factor folds into it:

| producer kind | fold of `x / s` into the producer |
|---|---|
| `rmsnorm` (y = x̂ · w) | w' = w / s |
| `rmsnorm_offset` (y = x̂ · (1 + w), Gemma) | w' = (1 + w) / s - 1 (never a `.bias`) |
| `layernorm` (y = x̂ · w + b, x̂ mean-centred or not; found by discovery) | w' = w / s, b' = b / s |
| `linear_rows` (a Linear whose rows feed the group, e.g. up_proj for down_proj) | rows' = rows / s |
| none | the group takes no smoothing |

A Linear fused on disk (Phi-3's `self_attn.qkv_proj`, GLM-4's `mlp.gate_up_proj`) is one
member of its group: one Hessian, one weight, one checkpoint entry under the fused name.
`on_disk` names the HF Linears it stands for, in row order (`("gate_proj", "up_proj")`), and
`producer_chunk` of a group fed by part of a fused producer says which rows feed it: down_proj
reads only the up half of gate_up_proj, so its fold divides rows `chunk 1 of 2` and no others.

`sole_consumer` says nothing else reads the producer's output (the residual stream takes the
un-normed sum), which both makes the fold an equivalence and lets calibration transform the
input in place.

A model type may have several specs told apart by its config (`ArchSpec.variant`: DeepSeek
with and without a low-rank query, `q_lora_rank`); `arch.spec_for_model` / `spec_for_config`
pick the one whose variant the config satisfies.

Decoder layers stored after the model's own (`index >= num_hidden_layers`: DeepSeek-V3's
multi-token-prediction layers) are not built by transformers; `is_extra_layer` names their
tensors, which calibration copies FLOAT and the checkpoint tools accept.

`rotation` (a `ResidualRotation`) says where an offline rotation of the residual stream
(R1) and the per-head v/o rotation (R2) fold (calibration/rotation.py); None where that is
no equivalence. `post_norms` names norms on a Linear's output before the residual add
(Gemma, GLM-4), which rule R1 out; the group whose output one reads names it
(`LinearGroup.output_norm`), so that calibration measures that Linear's error as the norm
passes it on (calibration/group.py, `output_norm_weights`).

A Mixture-of-Experts layer (`ArchSpec.moe`, arch/moe.py) replaces the dense MLP groups by
one gate/up and one down group per routed expert (templated on `{e}`), plus any shared
expert's groups; the router and shared-expert gate stay FLOAT. Which layers are MoE is read
from the config (`MoESpec.is_moe_layer`).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict, dataclass, field

import torch

PRODUCER_KINDS = ("rmsnorm", "rmsnorm_offset", "layernorm", "linear_rows")
# decoder layers are `<...>.layers.<i>.` in every family's checkpoint names (HF and vLLM alike)
LAYER_PATTERN = r"\.layers\.\d+\."
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def config_get(config, key: str, default=None):
    """`config.key` of a transformers config or a config.json dict (its text_config if nested)."""
    if isinstance(config, dict):
        inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        return inner.get(key, default)
    inner = getattr(config, "text_config", None) or config
    return getattr(inner, key, default)


class UnsupportedModelError(Exception):
    """The model's architecture has no spec and none can be discovered; the message names what is missing."""


@dataclass(frozen=True)
class LinearGroup:
    name: str                      # "qkv", "o", "gate_up", "down"
    linears: tuple[str, ...]       # paths relative to the decoder layer
    producer: str | None = None    # the module whose output the group reads (folds 1/s), or None
    producer_kind: str | None = None
    row_parallel: bool = False     # in-features split across tensor-parallel ranks (o_proj, down_proj)
    sole_consumer: bool = True     # the input is read by this group only
    vllm_fused: str | None = None  # the one vLLM Linear the group becomes (qkv_proj, gate_up_proj)
    # a single member fused on disk: the HF Linears it stands for, in row order (see the docstring)
    on_disk: tuple[str, ...] = ()
    # (index, count): the group reads rows chunk `index` of `count` of its Linear producer
    producer_chunk: tuple[int, int] | None = None
    expert: int | None = None      # a routed expert's group: its index (the names hold it)
    # a norm on the group's only member's output before the residual add (a post-norm, one of
    # ArchSpec.post_norms): it divides each token's output by its RMS, so calibration weighs
    # each token's output error by that 1 / RMS
    output_norm: str | None = None

    def __post_init__(self):
        if (self.producer is None) != (self.producer_kind is None) or \
                (self.producer_kind is not None and self.producer_kind not in PRODUCER_KINDS):
            raise ValueError(f"group {self.name}: producer {self.producer!r} of kind {self.producer_kind!r}")
        if self.on_disk and len(self.linears) != 1:
            raise ValueError(f"group {self.name}: a Linear fused on disk is the group's only member")
        if self.producer_chunk is not None and self.producer_kind != "linear_rows":
            raise ValueError(f"group {self.name}: producer_chunk needs a linear_rows producer")
        if self.output_norm is not None and len(self.linears) != 1:
            raise ValueError(f"group {self.name}: an output_norm reads one Linear's output")

    def producer_rows(self, n: int) -> slice:
        """The producer's rows (of `n`) the fold divides: all, or `producer_chunk`'s part."""
        if self.producer_chunk is None:
            return slice(None)
        i, count = self.producer_chunk
        if n % count:
            raise ValueError(f"group {self.name}: producer rows {n} do not split into {count} chunks")
        return slice(i * n // count, (i + 1) * n // count)


@dataclass(frozen=True)
class GatedMLP:
    """`down(act(gate(x)) * up(x))`, paths relative to the decoder layer."""
    gate: str
    up: str
    down: str
    activation: str = "silu"       # a name in transformers' ACT2FN (config.json's hidden_act)

    def activation_fn(self):
        """The activation as a function of gate's output."""
        from transformers.activations import ACT2FN
        return ACT2FN[self.activation]


@dataclass(frozen=True)
class ResidualRotation:
    """Where an orthogonal Q on the residual stream folds offline (R1; calibration/rotation.py),
    for a family where that is an equivalence: every norm on the residual is x̂ · w (its gain
    folds into the Linears it feeds, the groups with an `rmsnorm` producer), no norm sits on
    a Linear's output before the residual add, and nothing else reads the residual. Paths
    relative to the decoder layer unless said otherwise."""
    final_norm: str = "model.norm"                  # model path: the norm lm_head reads
    writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")   # outputs added to the residual
    value: str = "self_attn.v_proj"                 # R2: per KV head output rows ...
    output: str = "self_attn.o_proj"                # ... and the per-head input columns that read them


@dataclass(frozen=True)
class ArchSpec:
    name: str
    model_types: tuple[str, ...]
    groups: tuple[LinearGroup, ...]
    layers_path: str = "model.layers"
    # the Linears whose outputs the KV cache stores after RoPE: their checkpoint entries carry
    # C8's kv_cache_scale / kv_cache_offset; the attention function sees them post-RoPE
    kv_projections: tuple[str, ...] = ("self_attn.k_proj", "self_attn.v_proj")   # () : no C8 (MLA)
    vllm_attention: str = "self_attn.attn"      # vLLM's Attention module, relative to the layer
    mlp: GatedMLP | None = None
    notes: tuple[str, ...] = field(default=())
    moe: "MoESpec | None" = None                # Mixture-of-Experts layers (arch/moe.py)
    attention_module: str | None = None         # the attention module where kv_projections say nothing
    float_linears: tuple[str, ...] = ()         # Linears that must stay FLOAT (DeepSeek's kv_b_proj)
    mla_group: str | None = None                # the MLA input group: its scheme is config.json's `mla_quantize`
    # config keys whose values sum to the values a layer caches per token (MLA: the latent and
    # the RoPE key, stored once); () : K and V, 2 * num_key_value_heads * head_dim
    kv_cache_width: tuple[str, ...] = ()
    discovered: bool = False                    # built by arch/discovery.py (notes: its report)
    # why vllm-ascend 0.23 cannot load this family's checkpoints as written (verify notes it;
    # our runtime serves them), or None
    vllm_ascend_gap: str | None = None
    # (config key, whether it is set): of a model type's several specs, this one is for the
    # configs where `key` is set (not null), or unset; None: the model type's only spec
    variant: tuple[str, bool] | None = None
    # offline rotation map (R1/R2), or None: not an equivalence here, or not declared
    rotation: ResidualRotation | None = None
    # norms on a Linear's output before the residual add (Gemma, GLM-4): they rule R1 out
    post_norms: tuple[str, ...] = ()

    def __post_init__(self):
        for g in self.groups:
            if g.output_norm is not None and g.output_norm not in self.post_norms:
                raise ValueError(f"{self.name}: group {g.name}'s output_norm {g.output_norm!r} is not in post_norms")

    def fits(self, config) -> bool:
        """Whether this spec is the one for `config` (object or dict) among its model type's."""
        if self.variant is None:
            return True
        key, is_set = self.variant
        return (config_get(config, key) is not None) == is_set

    def is_extra_layer(self, name: str, config) -> bool:
        """A tensor (or module) of a decoder layer stored after the model's `num_hidden_layers`
        (DeepSeek-V3's MTP layers): transformers builds none, calibration copies them FLOAT."""
        n = config_get(config, "num_hidden_layers")
        i = self.layer_index(name) if name.startswith(self.layers_path + ".") else None
        return isinstance(n, int) and i is not None and i >= n

    def kv_values_per_token(self, config, kv_heads: int, head_dim: int) -> int | None:
        """Values one decoder layer's KV cache holds per token (see `kv_cache_width`)."""
        if not self.kv_cache_width:
            return 2 * kv_heads * head_dim
        parts = [config_get(config, k) for k in self.kv_cache_width]
        return sum(parts) if all(isinstance(p, int) and p > 0 for p in parts) else None

    def to_dict(self) -> dict:
        """A JSON-able form (saved with a calibrated checkpoint); `from_dict` reads it back.
        Discovered specs are dense: a MoE spec (`moe`) is never saved."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArchSpec":
        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, list) else v
        try:
            groups = tuple(LinearGroup(**{k: tup(v) for k, v in g.items()}) for g in d["groups"])
            mlp = GatedMLP(**d["mlp"]) if d.get("mlp") else None
            if d.get("moe"):
                raise ValueError("a saved spec has no MoE layers")
            rotation = ResidualRotation(**{k: tup(v) for k, v in d["rotation"].items()}) \
                if d.get("rotation") else None
            rest = {k: tup(v) for k, v in d.items() if k not in ("groups", "mlp", "moe", "rotation")}
            return cls(groups=groups, mlp=mlp, rotation=rotation, **rest)
        except (KeyError, TypeError, ValueError) as e:
            raise UnsupportedModelError(f"saved architecture spec is not readable: {e}") from None

    @property
    def attention(self) -> str:
        """The attention module (relative to the layer) whose function sees post-RoPE K/V."""
        return self.attention_module or self.kv_projections[0].rpartition(".")[0]

    # ------------------------------------------------------------------ model side
    def layers(self, model) -> torch.nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> list[str]:
        return [name for g in self.groups for name in g.linears]

    def is_moe_layer(self, index: int, config) -> bool:
        """Whether decoder layer `index` of a model with this config (object or dict) is MoE."""
        return self.moe is not None and self.moe.is_moe_layer(index, config)

    def layer_groups(self, index: int, config) -> tuple[LinearGroup, ...]:
        """The groups of decoder layer `index`: the dense ones, or for a MoE layer the dense
        ones but the MLP's, the shared expert's and each routed expert's."""
        if not self.is_moe_layer(index, config):
            return self.groups
        return self.moe.layer_groups(self.groups, self.moe.num_experts(config))

    def missing_modules(self, layer: torch.nn.Module, wanted: list[str] | None = None) -> list[str]:
        """The spec's Linears and producers (or `wanted`) the decoder layer does not have."""
        if wanted is None:
            wanted = self.linear_names() + [g.producer for g in self.groups if g.producer]
        return [n for n in wanted if not _has(layer, n)]

    def to_disk(self, name: str) -> str:
        """A model (state-dict or module) name as the checkpoint spells it (Mixtral's MoE block
        is `mlp` in transformers 5, `block_sparse_moe` on disk and in vLLM)."""
        return self.moe.to_disk(name) if self.moe is not None else name

    def from_disk(self, name: str) -> str:
        """The inverse of `to_disk`."""
        return self.moe.from_disk(name) if self.moe is not None else name

    # ------------------------------------------------------------------ checkpoint names
    def group_of(self, prefix: str) -> LinearGroup | None:
        """The group a checkpoint Linear (`model.layers.3.self_attn.q_proj`) belongs to."""
        rel = self.relative(prefix)
        if rel is not None and self.moe is not None:
            rel = self.moe.template(self.moe.from_disk_relative(rel))
            moe_groups = self.moe.groups + self.moe.shared_groups
            found = next((g for g in moe_groups if rel in g.linears), None)
            if found is not None:
                return found
        return next((g for g in self.groups if rel in g.linears), None)

    def relative(self, prefix: str) -> str | None:
        """`self_attn.q_proj` for `model.layers.3.self_attn.q_proj`; None outside the layers."""
        m = _LAYER_INDEX.search(prefix + ".")
        return prefix[m.end():] if m else None

    def fused_siblings(self, prefix: str) -> tuple[str, ...] | None:
        """The prefixes vLLM fuses with `prefix` into one Linear (itself included), or None."""
        g = self.group_of(prefix)
        if g is None or g.vllm_fused is None:
            return None
        base = prefix[: len(prefix) - len(self.relative(prefix))]
        return tuple(base + name for name in g.linears)

    def is_row_parallel(self, prefix: str) -> bool:
        g = self.group_of(prefix)
        return bool(g and g.row_parallel)

    def is_kv_projection(self, prefix: str) -> bool:
        return self.relative(prefix) in self.kv_projections

    def kv_role(self, prefix: str) -> str | None:
        """"k" or "v" for the K / V projection of a layer, else None."""
        rel = self.relative(prefix)
        return dict(zip(self.kv_projections, "kv")).get(rel)

    @staticmethod
    def layer_index(name: str) -> int | None:
        m = _LAYER_INDEX.search(name)
        return int(m.group(1)) if m else None

    @staticmethod
    def split_layer(name: str) -> tuple[str, int, str] | None:
        """`("model", 3, "self_attn.q_proj.weight")` for `model.layers.3.self_attn.q_proj.weight`."""
        m = _LAYER_INDEX.search(name)
        return (name[:m.start()], int(m.group(1)), name[m.end():]) if m else None

    @staticmethod
    def join_layer(before: str, index: int, after: str) -> str:
        return f"{before}.layers.{index}.{after}"

    def layer_prefix(self, prefix: str) -> str | None:
        """`model.layers.3` for any name inside that decoder layer."""
        rel = self.relative(prefix)
        return prefix[: len(prefix) - len(rel) - 1] if rel else None

    # ------------------------------------------------------------------ vLLM names
    def vllm_fused_members(self, vllm_leaf: str) -> tuple[str, ...] | None:
        """The checkpoint leaves behind a vLLM fused Linear (`qkv_proj` -> q/k/v_proj)."""
        for g in self.groups:
            if g.vllm_fused == vllm_leaf:
                return tuple(n.rpartition(".")[2] for n in g.linears)
        return None

    def norm_consumers(self) -> dict[str, str]:
        """RMSNorm -> the vLLM Linear that alone reads it (where a smoothing bias goes). Plain
        `rmsnorm` producers only: a (1+w) norm (`rmsnorm_offset`, Gemma) never takes a bias."""
        out = {}
        for g in self.groups:
            if g.producer_kind == "rmsnorm" and g.sole_consumer:
                parent = g.linears[0].rpartition(".")[0]
                leaf = g.vllm_fused or g.linears[0].rpartition(".")[2]
                out[g.producer] = f"{parent}.{leaf}" if parent else leaf
        return out

    def kv_cache_parent(self, scale_key: str) -> str | None:
        """`model.layers.3.self_attn` for the K projection's `...k_proj.kv_cache_scale` key; None
        for any other key (one C8 layer per K scale)."""
        prefix, _, suffix = scale_key.rpartition(".")
        if suffix != "kv_cache_scale" or self.kv_role(prefix) != "k":
            return None
        return prefix.rpartition(".")[0]


def norm_eps(module: torch.nn.Module) -> float:
    """A norm module's epsilon (transformers names it `eps` or `variance_epsilon`; 1e-6 if neither)."""
    return next((v for a in ("eps", "variance_epsilon") if isinstance(v := getattr(module, a, None), float)), 1e-6)


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


@contextlib.contextmanager
def lean_mlp(layer: torch.nn.Module, spec: ArchSpec):
    """Within the block the layer's gated SiLU MLP computes `down(silu(gate(x)) * up(x))` with
    the activation and the product formed in gate's output: one [tokens, intermediate]
    buffer less at the calibrator's peak (85 MB on SmolLM2-135M's 13.8k tokens), the same
    values. Other MLPs run as they are."""
    m = spec.mlp
    parent = m.gate.rpartition(".")[0] if m else ""
    module = layer.get_submodule(parent) if m and parent else None
    names = [p.rpartition(".")[2] for p in (m.gate, m.up, m.down)] if m else []
    if module is None or m.activation != "silu" or not _is_silu(getattr(module, "act_fn", None)) \
            or not all(hasattr(module, n) for n in names):
        yield
        return
    gate, up, down = (getattr(module, n) for n in names)

    def forward(x):
        h = torch.nn.functional.silu(gate(x), inplace=True)
        return down(h.mul_(up(x)))

    module.forward = forward
    try:
        yield
    finally:
        del module.forward
