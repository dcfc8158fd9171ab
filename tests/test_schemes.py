"""Each scheme file against the format document: what `pack` writes has the shapes and dtypes
its `tensor_specs` declares, `unpack` gives back the same Linear, and the scheme's own kernels
(reference backend) compute what tests/format_oracle.py, written from ascend-format.md alone,
says those tensors mean. And nothing outside ascend_quant/schemes/ compares a scheme name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import format_oracle
from ascend_quant import numerics
from ascend_quant.runtime.kernels import backend
from ascend_quant.schemes import LINEAR_SCHEMES, SCHEMES, PreparedLinear, QuantizedLinear, checkpoint_entries

N, K, G = 48, 128, 32
# (scheme, group size, two-stage, row-parallel)
VARIANTS = [("W8A8", 0, False, False), ("W8A8_DYNAMIC", 0, False, False), ("W8A16", 0, False, False),
            ("W8A16", G, False, False), ("W4A16", G, False, False), ("W4A8_DYNAMIC", 0, False, False),
            ("W4A8_DYNAMIC", 0, False, True), ("W4A8_DYNAMIC", G, True, False), ("W4A8_DYNAMIC", G, True, True)]


def _linear(name: str, group: int, two_stage: bool, row_parallel: bool, dtype) -> QuantizedLinear:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(N, K, generator=g) * 0.05
    bias = torch.randn(N, generator=g) * 0.1
    scheme = SCHEMES[name]
    if two_stage:
        q, s1, s2 = numerics.two_stage_int4(w, group)
        return QuantizedLinear(name, q, s1, bias, s2, row_parallel=row_parallel)
    q, s = numerics.quantize_weight(w, scheme.weight_bits, group)
    extra = {}
    if scheme.activation_mode == "static":
        extra = dict(zip(("input_scale", "input_offset"), numerics.activation_qparams(-1.7, 2.3)))
    return QuantizedLinear(name, q, s, bias, row_parallel=row_parallel, **extra)


def _id(v):
    name, group, two_stage, row_parallel = v
    return f"{name}-g{group}" + ("-two-stage" if two_stage else "") + ("-row" if row_parallel else "")


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_matches_specs_and_unpack_round_trips(variant, dtype):
    name, group, two_stage, row_parallel = variant
    scheme = SCHEMES[name]
    ql = _linear(*variant, dtype)
    packed = scheme.pack(ql, dtype)
    specs = scheme.tensor_specs(N, K, group, two_stage=two_stage, row_parallel=row_parallel)
    assert set(packed) == set(specs)
    for suffix, spec in specs.items():
        assert packed[suffix].dtype in spec.accepted, suffix
        assert tuple(packed[suffix].shape) == spec.shape, suffix
    shapes = {s: tuple(t.shape) for s, t in packed.items()}
    assert scheme.layout_of(shapes, group) == (group, two_stage)
    again = scheme.pack(scheme.unpack(dict(packed)), dtype)
    for suffix in packed:
        if suffix != "quant_bias":                 # the float bias is not part of the unpacked Linear
            assert torch.equal(again[suffix], packed[suffix]), suffix


# per-group W8A16 is our runtime's extension: the format document (and so the oracle) has
# W8A16 per channel only
DOCUMENTED = [v for v in VARIANTS if not (v[0] == "W8A16" and v[1])]


@pytest.mark.parametrize("variant", DOCUMENTED, ids=_id)
def test_scheme_kernels_compute_what_the_document_says(variant):
    name, group, two_stage, row_parallel = variant
    prefix = "model.layers.0.mlp.down_proj"
    entries = checkpoint_entries(_linear(*variant, torch.float32), prefix, torch.float32)
    tensors = {k: v for k, (v, _) in entries.items()}
    desc = {k: t for k, (_, t) in entries.items()}
    weight, bias, act = format_oracle.dequantized_linear(tensors, desc, prefix)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3))
    want = torch.nn.functional.linear(act(x) if act else x, weight, bias)
    own = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k != f"{prefix}.bias"}
    got = PreparedLinear.build(name, own, backend=backend("reference"))(x, tensors.get(f"{prefix}.bias"))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_every_linear_scheme_has_a_variant_here():
    assert {v[0] for v in VARIANTS} == set(LINEAR_SCHEMES)


def test_no_scheme_name_is_compared_outside_schemes():
    """A scheme name in quotes anywhere in the package but ascend_quant/schemes/ means scheme
    knowledge leaked out of its file (docstrings and comments excepted)."""
    root = Path(__file__).resolve().parents[1] / "ascend_quant"
    names = "|".join(re.escape(n) for n in SCHEMES)
    quoted = re.compile(rf"""["']({names})["']""")
    found = []
    for path in sorted(root.rglob("*.py")):
        if "schemes" in path.relative_to(root).parts:
            continue
        code = _code_only(path.read_text())
        found += [f"{path.relative_to(root)}:{i}: {line.strip()}" for i, line in enumerate(code.splitlines(), 1)
                  if quoted.search(line)]
    assert not found, "\n".join(found)


def _code_only(source: str) -> str:
    """The source with comments and docstrings blanked (line numbers kept)."""
    import io
    import tokenize

    lines = source.splitlines(keepends=True)
    out = [list(line) for line in lines]
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        docstring = tok.type == tokenize.STRING and prev in (None, tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT)
        if tok.type == tokenize.COMMENT or docstring:
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = out[r - 1]
                a = c0 if r == r0 else 0
                b = c1 if r == r1 else len(row)
                for c in range(a, b):
                    if row[c] != "\n":
                        row[c] = " "
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    return "".join("".join(r) for r in out)
