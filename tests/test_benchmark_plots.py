"""The benchmarks' plots (issue 17's speed targets are read from them beside the tables), drawn
from result files that real runs wrote (benchmarks/results/), with matplotlib, which `make
install` puts in the venv (the `bench` extra)."""

import importlib.util
import json
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    """As when a benchmark runs as a script: its folder on sys.path (they import runtime.py's helpers)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's header (the IHDR chunk), read without matplotlib."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def test_runtime_e2e_plot(tmp_path):
    """One bar per engine that has figures, so the figure grows with the engines' count."""
    bench = _load("runtime")
    e2e = json.loads((ROOT / "benchmarks/results/runtime-e2e-compiled-zen4.json").read_text())["e2e"]
    assert bench.plot_e2e(e2e, tmp_path / "all.png")
    three = {**e2e, "engines": {k: e2e["engines"][k] for k in list(e2e["engines"])[:3]}}
    assert bench.plot_e2e(three, tmp_path / "three.png")
    (w_all, h_all), (w3, h3) = _png_size(tmp_path / "all.png"), _png_size(tmp_path / "three.png")
    assert w_all == w3 and h_all > h3
    # no engine with figures (every one failed): no plot rather than an empty figure
    failed = {**e2e, "engines": {k: {"error": "init failed"} for k in e2e["engines"]}}
    assert not bench.plot_e2e(failed, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("keys", ["str", "int"])
def test_kv_cache_plot(tmp_path, keys):
    """From the JSON as written (concurrency keys read back as strings) and as held in the
    benchmark's process (ints)."""
    bench = _load("kv_cache")
    r = json.loads((ROOT / "benchmarks/results/kv_cache-zen4.json").read_text())
    if keys == "int":
        for e in r["engines"].values():
            e["throughput"] = {int(c): v for c, v in e["throughput"].items()}
    assert bench.plot(r, tmp_path / "kv.png")
    w, h = _png_size(tmp_path / "kv.png")
    assert w > h > 0
