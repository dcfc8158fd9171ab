"""The recipe's `online_rotation`: a randomized Hadamard Q on each dense MLP's down_proj input,
applied at inference (QuaRot's online transform before down_proj, SpinQuant's R4).

down_proj computes (x·Q)·(w·Q)ᵀ = x·wᵀ: in float nothing changes, but x·Q spreads the few
large channels of the MLP's activation over all of them, so per-token int8 activations (W4A8,
W8A8_DYNAMIC) lose less. Unlike the offline rotation (rotation.py) it needs no norm folding, so
post-norm families (Gemma) take it too. Calibration rotates each layer's down_proj weight as
the layer is reached and its input with a forward pre-hook that runs before every calibration
hook, so observers, GPTQ and the error report all see x·Q. The checkpoint stores w·Q (then
quantized) and the signs of Q as `<down_proj>.input_rotation` (FLOAT, float32 [k]); the
reference model and our vLLM method rotate the input with `numerics.rotate_activation`. vllm-ascend
has no parameter for that tensor and refuses the checkpoint at load (verify says so).

Smoothing or AWQ through up_proj is off for the down group: a factor folded into up_proj's
rows scales the unrotated channels, not the ones down_proj reads."""

from __future__ import annotations

import torch

from ascend_quant import numerics
from ascend_quant.arch import ArchSpec
from ascend_quant.schemes import INPUT_ROTATION

# (signs, Kronecker factors of H) of a rotated module, float32, for its pre-hook (not in the state dict)
Q_ATTR = "ascend_input_rotation"


def refusal(model: torch.nn.Module, spec: ArchSpec) -> str | None:
    """Why this model takes no online rotation of down_proj's input, or None."""
    if spec.moe is not None:
        return f"{spec.name}: no online rotation on Mixture-of-Experts models (their experts' down_proj)"
    if spec.mlp is None:
        return f"{spec.name}: no online rotation: its architecture spec names no dense gated MLP"
    for layer in spec.layers(model):
        k = layer.get_submodule(spec.mlp.down).weight.shape[1]
        if numerics.hadamard_parts(k) is None:
            return f"{spec.name}: no online rotation: no Hadamard matrix of order {k} here (2^a times a Paley order)"
    return None


def _rotate_hook(module, args):
    x = args[0]
    signs, factors = getattr(module, Q_ATTR)
    return (numerics.rotate_activation(x, signs.to(x.dtype), tuple(f.to(x.dtype) for f in factors)), *args[1:])


def attach(module: torch.nn.Module) -> None:
    """(Re-)install the input rotation hook of a module rotated by `rotate_layer` (a deep copy
    that dropped its hooks gets it back)."""
    module.register_forward_pre_hook(_rotate_hook)


def rotated_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in layer.modules() if hasattr(m, Q_ATTR)]


def rotate_layer(layer: torch.nn.Module, spec: ArchSpec, generator: torch.Generator) -> str:
    """Rotate one decoder layer's down_proj: weight w·Q, signs as the `input_rotation` buffer,
    the input hook. Call before any calibration hook is registered on it. Returns its path."""
    down = layer.get_submodule(spec.mlp.down)
    signs = numerics.rotation_signs(down.weight.shape[1], generator)
    factors = numerics.rotation_factors(signs.numel())
    w = down.weight.data        # w·Q: each row of w is rotated as an input row would be (float64)
    down.weight.data = numerics.rotate_activation(w.double(), signs.double(), factors).to(w.dtype)
    down.register_buffer(INPUT_ROTATION, signs)
    setattr(down, Q_ATTR, (signs, tuple(f.float() for f in factors)))
    attach(down)
    return spec.mlp.down
