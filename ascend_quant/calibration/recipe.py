"""Recipes: which algorithm quantizes which Linear, as presets per scheme or a YAML file.

A YAML recipe (loaded with `yaml.safe_load`) names a scheme and steps, plus per-layer
overrides matched with shell-style patterns on the module name:

    scheme: w8a8                  # w8a8, w8a8-dynamic, w8a16, w4a8, w4a16
    method: gptq                  # minmax or gptq
    group_size: 0
    smoothquant: {alpha: 0.8, smooth_down: true, alphas: [0.5, 0.7, 0.9], group_alpha: {down: 0.5}}
    activations: {observer: percentile, percentile: 99.99}
    gptq: {damp: 0.01, block_size: 128, act_order: true, float_target: false, gate_up_clusters: 8}
    awq: {alphas: [0.0, 0.25, 0.5, 0.75, 1.0], clip: true}   # weight-rounding search (see AWQ)
    weights: {symmetric: false}   # zero points (W4A16 only)
    kv_cache: {dtype: int8, method: mse}
    moe: {tokens: routed, min_tokens: 32}        # MoE experts (see MoE below)
    rotation: {kind: hadamard, r2: true, seed: 0, where_supported: false}  # offline R1/R2 first (rotation.py)
    online_rotation: {seed: 0}    # a Hadamard on down_proj's input at inference (our runtime only)
    ignore: ["lm_head"]           # module patterns left in float
    float_groups: [down]          # Linear groups left in float, by role (qkv, o, gate_up, down)
    overrides:
      - {match: "model.layers.0.*", scheme: w8a8-dynamic}

The recipe actually used is saved next to the checkpoint as `ascend_quant_recipe.yaml`.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ascend_quant.calibration.kv import KV_METHODS
from ascend_quant.arch import FAMILIES
from ascend_quant.schemes import CLI_NAMES, FLOAT, SCHEMES, W8A8_DYNAMIC, get_scheme

RECIPE_FILE = "ascend_quant_recipe.yaml"


class RecipeError(Exception):
    """An invalid recipe; the message names the file and the key."""


@dataclass
class SmoothQuant:
    alpha: float = 0.5
    smooth_down: bool = True          # also smooth down_proj's input through up_proj's rows
    # candidates searched per group of Linears (plus no smoothing): the one whose quantized
    # output is closest to the float output on a token sample wins; empty: `alpha` everywhere
    alphas: list[float] = field(default_factory=list)
    # a fixed alpha for some groups (qkv, o, gate_up, down), before `alphas` and `alpha`
    group_alpha: dict[str, float] = field(default_factory=dict)
    # False: only where the model is not rotated (a rotation already spreads the outliers, and
    # smoothing on top moves them into 4-bit weights: W4A8's preset)
    rotated: bool = True


@dataclass
class Activations:
    # static W8A8 only: minmax, percentile, mse (the range that minimises the Linears' output
    # error), or running (msModelSlim's own semantics: each calibration sample is
    # fake-quantized with the range seen so far; reproduces its files)
    observer: str = "minmax"
    percentile: float = 99.99


@dataclass
class GPTQ:
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    mse_scales: bool = True           # MSE-clipped scales before the sweep (the 4-bit presets)
    # Hessian from an even stride of at most max(hessian_tokens, 4 * in_features) tokens
    # (0: all): on SmolLM2-135M the capped Hessians cost 40% of the time and no accuracy
    hessian_tokens: int = 4096
    # True: each GPTQ Linear is fitted to the float model's output (its float input runs through
    # a float copy of the layers alongside), not to its own unquantized output on the input the
    # quantized layers before it produce: GPTAQ's asymmetric calibration (gptq.float_target_weight)
    float_target: bool = False
    # where the model is not rotated: true, the float target as above; false, none (W4A16's
    # preset: on unrotated Gemma-3 it lost 2.7 points, on rotated SmolLM2 it won 0.4 to 1.1);
    # a number in (0, 1), that float_target_share there (W4A8's preset: 0.25)
    float_target_unrotated: bool | float = True
    # the part of the way from W to the float target's fit W* that GPTQ starts from (1: W*;
    # less shrinks the fit's correction, which overshoots on unrotated Gemma-3)
    float_target_share: float = 1.0
    # where float_target applies, GPTQ's Hessian and the float-target fit take at most this
    # many tokens instead of hessian_tokens (0: all): the fit solves for k weights per output
    # row, which a sample of a few k tokens may overfit (W4A16 on rotated SmolLM2, stop 39)
    float_target_tokens: int = 65536
    # > 0: in a gated MLP (arch GatedMLP: down(act(gate(x)) * up(x))) gate's and up's rows are
    # rounded for the product, not for their own outputs: a token counts for up's row j with
    # act(g_j)^2 and for gate's with (act'(g_j) u_j)^2 (how row j's error reaches down's input),
    # the rows are grouped by those token weights into this many clusters (k-means), and GPTQ
    # runs once per cluster on that cluster's weighted Hessian (group.gate_up_row_weights);
    # 0: one Hessian for all rows, every token alike. Not where float_target applies: its fit
    # W* is the least-squares solution for the shared Hessian, not for the clusters'
    gate_up_clusters: int = 0


@dataclass
class AWQ:
    # activation-aware scaling per group of Linears with a producer: s = mean|x|^alpha folded
    # into the producer, the alpha (or no scaling) whose output with the scheme's own weight
    # (and activation) quantizer is closest to the float output on a token sample wins; it
    # replaces SmoothQuant where both are given. Empty: no scaling, clip search only
    alphas: list[float] = field(default_factory=lambda: [i / 10 for i in range(11)])
    # how candidates are scored: minmax (the scheme's min-max weights, cheap) or final (each
    # Linear's own rounding: clip search, GPTQ; one rounding of the group per candidate)
    score: str = "minmax"
    # also the two-sided candidates s = mean|x|^alpha / mean(|w| / group max)^(1 - alpha) for
    # each alpha below 1 (recorded as "duo ALPHA"; llm-compressor's duo_scaling "both")
    duo: bool = False
    # then per row or group of each Linear the range shrink ratio in [clip_min, 1] (clip_grid
    # steps) with the smallest output error of that group's part of the product; GPTQ, if it
    # runs, keeps those scales
    clip: bool = True
    clip_min: float = 0.7
    clip_grid: int = 12
    # False: only where the model is not rotated (W8A8_DYNAMIC's preset: on a rotated model
    # SmoothQuant's fixed alphas rose less than AWQ)
    rotated: bool = True
    # False: not on Mixture-of-Experts models, which keep SmoothQuant if the recipe gives it
    # (W4A8's preset: no real MoE model measured, and on the tiny random test MoEs AWQ raised
    # the output error)
    moe: bool = True


@dataclass
class Weights:
    # False: asymmetric weights with a zero point per row or group (schemes that store one: W4A16)
    symmetric: bool = True
    # True: once the integer codes are chosen (min-max or GPTQ), each row's scales (and zero
    # points) are refitted by least squares to the layer's output on the calibration inputs
    # (gptq.refit_scales); two-stage int4 refits s1 only, s2 stays an integer
    refit: bool = False
    # True: where a post-norm reads the Linear's output (Gemma's and GLM-4's o_proj / down_proj,
    # arch LinearGroup.output_norm), each calibration token's output error counts with the weight
    # 1 / RMS(output) that the norm gives it, in AWQ's and the clip search's losses and GPTQ's
    # Hessian (group.output_norm_weights); False: every token alike. No effect on min-max rounding
    post_norm: bool = True


@dataclass
class Tune:
    # block tuning (calibration/blocktune.py): once a dense decoder layer's Linears are rounded,
    # its weight-only Linears' codes and group scales are tuned together to the layer's output,
    # AutoRound's signed gradient descent (Cheng et al., 2023): a shift of each value the rounding
    # rounded (within +-0.5 code, so a code moves at most one step) and a gain on each scale
    # (within +-max_gain), minimising each token's squared output error relative to its size
    # against a float copy of the layer. `iters` steps of `batch` calibration samples each, the
    # step size falling linearly from `lr` to 0; the tuned layer is kept only if its error over
    # all calibration samples is lower than before. AutoRound starts from min-max rounding
    # (`method: minmax`); started from GPTQ it undoes GPTQ's error compensation (README). The
    # defaults are the min-max run measured on Gemma-3-270m (AutoRound's own: 200 steps, lr 1/200)
    iters: int = 100
    batch: int = 4
    lr: float = 0.005
    max_gain: float = 0.3
    # the target: own (the float layer on the input the quantized layers before it give) or
    # float (the float model's own hidden states, AutoRound's); with gptq.float_target always float
    target: str = "own"


@dataclass
class KVCache:
    dtype: str = "int8"
    method: str = "mse"               # mse, absmax, msmodelslim


@dataclass
class MoE:
    # routed: each expert is calibrated on the tokens the router sends it; one with fewer
    # than `min_tokens` real tokens falls back to min-max weights (no smoothing, no GPTQ) and
    # the report names it. all: every token runs through every expert for its statistics
    # (its output still takes only the routed tokens), so no expert lacks data
    tokens: str = "routed"
    min_tokens: int = 32


@dataclass
class Rotation:
    # offline R1 (+ R2) before calibration (calibration/rotation.py): hadamard (randomized
    # Hadamard; sizes 2^a times a Paley order) or random (Haar-random orthogonal, any size)
    kind: str = "hadamard"
    r2: bool = True                   # also the per-head rotation of v_proj rows / o_proj columns
    seed: int = 0                     # the random signs (or matrices)
    # True: only where the family takes an offline rotation (calibration/rotation.py); elsewhere
    # (post-norm Gemma, GLM-4, MoE, discovered) the model is calibrated unrotated and the
    # calibration record says why. False: a refusal is an error
    where_supported: bool = False


@dataclass
class OnlineRotation:
    # a randomized Hadamard on each dense MLP's down_proj input, applied at inference (QuaRot's
    # online transform, SpinQuant's R4): the checkpoint stores down_proj's weight as w·Q and its
    # signs as `down_proj.input_rotation`; ascend-quant's runtime serves it, vllm-ascend does not
    seed: int = 0
    # True: only where every layer has a dense gated MLP whose width has a Hadamard matrix here;
    # elsewhere (MoE, discovered) the model is calibrated without it and the record says why.
    # False: those are an error
    where_supported: bool = False


@dataclass
class Override:
    match: str
    scheme: str | None = None         # a CLI or description name; "float" keeps the Linear in float
    method: str | None = None


@dataclass
class Recipe:
    scheme: str = W8A8_DYNAMIC.name   # description name
    method: str = "gptq"
    group_size: int = 0
    smoothquant: SmoothQuant | None = None
    activations: Activations = field(default_factory=Activations)
    gptq: GPTQ = field(default_factory=GPTQ)
    awq: AWQ | None = None
    weights: Weights = field(default_factory=Weights)
    tune: Tune | None = None
    kv_cache: KVCache | None = None
    moe: MoE = field(default_factory=MoE)
    rotation: Rotation | None = None
    online_rotation: OnlineRotation | None = None
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    # Linear groups left in float, by the architecture spec's role names (qkv, o, gate_up,
    # down): the same Linears in every family, whatever their modules are called
    float_groups: list[str] = field(default_factory=list)
    overrides: list[Override] = field(default_factory=list)

    # ------------------------------------------------------------ per-layer resolution
    def scheme_for(self, module: str, group: str | None = None) -> str:
        """The description type for a Linear of the spec group `group` (FLOAT if ignored)."""
        if group in self.float_groups or any(fnmatch.fnmatchcase(module, p) for p in self.ignore):
            return FLOAT.name
        scheme = self.scheme
        for o in self.overrides:
            if o.scheme and fnmatch.fnmatchcase(module, o.match):
                scheme = normalize_scheme(o.scheme)
        return scheme

    def method_for(self, module: str) -> str:
        method = self.method
        for o in self.overrides:
            if o.method and fnmatch.fnmatchcase(module, o.match):
                method = o.method
        return method

    def to_yaml(self) -> str:
        data = dataclasses.asdict(self)
        inverse = {v: k for k, v in CLI_NAMES.items()}
        data["scheme"] = inverse.get(self.scheme, self.scheme)
        return yaml.safe_dump(data, sort_keys=False)


def normalize_scheme(name: str) -> str:
    low = str(name).lower()
    if low in CLI_NAMES:
        return CLI_NAMES[low]
    if name in SCHEMES and not SCHEMES[name].kv_cache:
        return name
    raise RecipeError(f"unknown scheme {name!r} (use {', '.join(CLI_NAMES)})")


def preset(scheme: str, group_size: int | None = None) -> Recipe:
    """The recipe we recommend for a scheme: its `preset` (ascend_quant.schemes, measured on
    SmolLM2-135M; see README), with `group_size` (or the scheme's default) where the scheme
    takes one."""
    s = get_scheme(normalize_scheme(scheme))
    recipe = Recipe(s.name, group_size=s.group_size_for(s.default_group_size if group_size is None else group_size))
    _apply(recipe, copy.deepcopy(s.preset), f"preset {s.name}")
    return recipe


def _apply(recipe: Recipe, data: dict, where: str) -> None:
    """Recipe-file keys (all but `scheme`) onto `recipe`."""
    for key, value in data.items():
        at = f"{where}: {key}"
        if key == "smoothquant":
            recipe.smoothquant = _build(SmoothQuant, value, at)
        elif key == "activations":
            recipe.activations = _build(Activations, value, at)
        elif key == "gptq":
            recipe.gptq = _build(GPTQ, value, at)
        elif key == "awq":
            recipe.awq = _build(AWQ, value, at)
        elif key == "weights":
            recipe.weights = _build(Weights, value, at) or Weights()
        elif key == "tune":
            recipe.tune = _build(Tune, value, at)
        elif key == "kv_cache":
            recipe.kv_cache = _build(KVCache, value, at)
        elif key == "rotation":
            recipe.rotation = _build(Rotation, value, at)
        elif key == "online_rotation":
            recipe.online_rotation = _build(OnlineRotation, value, at)
        elif key == "moe":
            recipe.moe = _build(MoE, value, at) or MoE()
        elif key == "overrides":
            recipe.overrides = [_build(Override, o, f"{at}[{i}]") for i, o in enumerate(value or [])]
            for o in recipe.overrides:
                if o.scheme:
                    normalize_scheme(o.scheme)
        elif key in ("method", "group_size", "ignore", "float_groups"):
            setattr(recipe, key, value)
        else:
            raise RecipeError(f"{where}: unknown key {key!r}")


def _build(cls, data: dict, where: str):
    if data is None:
        return None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(names))})")
    return cls(**data)


def load_recipe(path: str | Path) -> Recipe:
    """Read a YAML recipe; every error names the file and the key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or "scheme" not in data:
        raise RecipeError(f"{path}: a recipe is a mapping with at least a 'scheme' key")
    data = dict(data)
    try:
        scheme = normalize_scheme(data.pop("scheme"))
        recipe = preset(scheme, data.get("group_size"))
        _apply(recipe, data, str(path))
    except RecipeError as e:
        raise RecipeError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{path}: {e}") from None
    validate(recipe, str(path))
    return recipe


def validate(recipe: Recipe, where: str = "recipe") -> None:
    if recipe.method not in ("minmax", "gptq"):
        raise RecipeError(f"{where}: method must be minmax or gptq, got {recipe.method!r}")
    if recipe.activations.observer not in ("minmax", "percentile", "mse", "running"):
        raise RecipeError(f"{where}: activations.observer must be minmax, percentile, mse or running")
    if recipe.activations.observer == "running" and (recipe.method != "minmax" or recipe.smoothquant):
        raise RecipeError(f"{where}: the running observer reproduces msModelSlim's min-max flow: "
                          "use method minmax without smoothquant")
    if recipe.kv_cache and recipe.kv_cache.method not in KV_METHODS:
        raise RecipeError(f"{where}: kv_cache.method must be one of {', '.join(KV_METHODS)}")
    if recipe.kv_cache and recipe.kv_cache.dtype != "int8":
        raise RecipeError(f"{where}: kv_cache.dtype must be int8")
    if recipe.group_size and not get_scheme(recipe.scheme).group_size_for(recipe.group_size):
        raise RecipeError(f"{where}: {recipe.scheme} is per-channel only; drop group_size")
    sq = recipe.smoothquant
    if sq and not isinstance(sq.rotated, bool):
        raise RecipeError(f"{where}: smoothquant.rotated must be true or false")
    if sq and not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0
                      for a in [sq.alpha, *sq.alphas, *sq.group_alpha.values()]):
        raise RecipeError(f"{where}: smoothquant alpha, alphas and group_alpha must be within [0, 1]")
    awq = recipe.awq
    if awq and not (all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in awq.alphas)
                    and isinstance(awq.clip_min, (int, float)) and 0.0 < awq.clip_min <= 1.0
                    and isinstance(awq.clip_grid, int) and awq.clip_grid >= 1):
        raise RecipeError(f"{where}: awq alphas must be within [0, 1], clip_min within (0, 1], clip_grid a count >= 1")
    if awq and not all(isinstance(v, bool) for v in (awq.rotated, awq.moe, awq.duo)):
        raise RecipeError(f"{where}: awq.rotated, awq.moe and awq.duo must be true or false")
    g = recipe.gptq
    if not isinstance(g.float_target, bool):
        raise RecipeError(f"{where}: gptq.float_target must be true or false")
    if not (isinstance(g.float_target_unrotated, (bool, int, float)) and 0 <= g.float_target_unrotated <= 1):
        raise RecipeError(f"{where}: gptq.float_target_unrotated must be true, false or a share within [0, 1], "
                          f"got {g.float_target_unrotated!r}")
    if not (isinstance(g.float_target_share, (int, float)) and not isinstance(g.float_target_share, bool)
            and 0 < g.float_target_share <= 1):
        raise RecipeError(f"{where}: gptq.float_target_share must be a share within (0, 1], got {g.float_target_share!r}")
    if not all(isinstance(v, bool) for v in (recipe.weights.symmetric, recipe.weights.refit, recipe.weights.post_norm)):
        raise RecipeError(f"{where}: weights.symmetric, weights.refit and weights.post_norm must be true or false")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (recipe.gptq.hessian_tokens, recipe.gptq.float_target_tokens)):
        raise RecipeError(f"{where}: gptq.hessian_tokens and gptq.float_target_tokens must be counts >= 0 (0: all)")
    clusters = recipe.gptq.gate_up_clusters
    if not isinstance(clusters, int) or isinstance(clusters, bool) or clusters < 0:
        raise RecipeError(f"{where}: gptq.gate_up_clusters must be a count >= 0 (0: off), got {clusters!r}")
    t = recipe.tune
    if t and not (all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (t.iters, t.batch))
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (t.lr, t.max_gain))
                  and t.max_gain < 1):
        raise RecipeError(f"{where}: tune.iters and tune.batch must be counts >= 1, tune.lr > 0 and "
                          f"tune.max_gain within (0, 1), got {t}")
    if t and t.target not in ("own", "float"):
        raise RecipeError(f"{where}: tune.target must be own or float, got {t.target!r}")
    if awq and awq.score not in ("minmax", "final"):
        raise RecipeError(f"{where}: awq.score must be minmax or final, got {awq.score!r}")
    if not recipe.weights.symmetric and not get_scheme(recipe.scheme).weight_zero_points:
        zp = ", ".join(n for n, s in SCHEMES.items() if s.weight_zero_points)
        raise RecipeError(f"{where}: weights.symmetric false (zero points) needs a scheme that stores them ({zp}), "
                          f"not {recipe.scheme}")
    if recipe.moe.tokens not in ("routed", "all") or not isinstance(recipe.moe.min_tokens, int) \
            or recipe.moe.min_tokens < 0:
        raise RecipeError(f"{where}: moe.tokens must be routed or all, moe.min_tokens a count >= 0")
    rot = recipe.rotation
    if rot and (rot.kind not in ("hadamard", "random") or not isinstance(rot.r2, bool)
                or not isinstance(rot.seed, int) or isinstance(rot.seed, bool)
                or not isinstance(rot.where_supported, bool)):
        raise RecipeError(f"{where}: rotation.kind must be hadamard or random, rotation.r2 and "
                          "rotation.where_supported true or false, rotation.seed an integer")
    online = recipe.online_rotation
    if online and (not isinstance(online.seed, int) or isinstance(online.seed, bool)
                   or not isinstance(online.where_supported, bool)):
        raise RecipeError(f"{where}: online_rotation.seed must be an integer, online_rotation.where_supported "
                          "true or false")
    groups = {g.name for spec in FAMILIES
              for g in spec.groups + ((spec.moe.groups + spec.moe.shared_groups) if spec.moe else ())}
    if set(recipe.float_groups) - groups:
        raise RecipeError(f"{where}: float_groups: unknown group(s) "
                          f"{', '.join(sorted(set(recipe.float_groups) - groups))} (groups: {', '.join(sorted(groups))})")
    if sq and set(sq.group_alpha) - groups:
        raise RecipeError(f"{where}: smoothquant.group_alpha: unknown group(s) "
                          f"{', '.join(sorted(set(sq.group_alpha) - groups))} (groups: {', '.join(sorted(groups))})")
