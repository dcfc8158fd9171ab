"""The reader loads every msModelSlim layout; the writer emits v1, atomically, and round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from ascend_quant.formats import ascend
from ascend_quant.formats.ascend import CheckpointError, copy_checkpoint, read_checkpoint, write_checkpoint
from ascend_quant.formats.verify import verify
from conftest import GOLDEN, fixture_dir

EXPECTED_LAYOUT = {"v1_w8a8_static_c8": "v1-sharded", "v1_w8a8_dyn": "v1", "v1_w8a16_w4a8": "v1",
                   "v0_w8a8": "v0", "v0_w4a8": "v0", "v0_w4a16": "v0"}


@pytest.mark.parametrize("name", GOLDEN)
def test_reader_loads_every_golden_folder(name):
    ckpt = read_checkpoint(fixture_dir(name))
    assert ckpt.layout == EXPECTED_LAYOUT[name]
    assert set(ckpt.description) == set(ckpt.infos)          # every tensor described, nothing extra
    mods = ckpt.modules()
    q = mods["model.layers.0.self_attn.q_proj"]
    assert q.weight_scheme == ckpt.meta["model_quant_type"] or name == "v1_w8a16_w4a8"
    assert q.scheme_of("bias") == "FLOAT"
    tensors = ckpt.tensors()
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8


def test_reader_groups_layer_scheme_tensors():
    ckpt = read_checkpoint(fixture_dir("v1_w8a8_static_c8"))
    k = ckpt.modules()["model.layers.1.self_attn.k_proj"]
    assert k.schemes["W8A8"] == {"weight", "input_scale", "input_offset", "deq_scale", "quant_bias"}
    assert k.schemes["C8"] == {"kv_cache_scale", "kv_cache_offset"}
    assert k.schemes["FLOAT"] == {"bias"}
    assert ckpt.kv_cache_int8 and ckpt.model_dtype == torch.float32
    mixed = read_checkpoint(fixture_dir("v1_w8a16_w4a8")).modules()
    assert mixed["model.layers.0.mlp.down_proj"].weight_scheme == "W4A8_DYNAMIC"
    assert mixed["model.layers.0.self_attn.o_proj"].weight_scheme == "W8A16"


def test_reader_accepts_mindie_description_name(golden_copy):
    d = golden_copy("v0_w8a8")
    (d / "quant_model_description.json").rename(d / "quant_model_description_w8a8.json")
    ckpt = read_checkpoint(d)
    assert ckpt.layout == "mindie"
    assert ckpt.description["model.layers.0.mlp.down_proj.deq_scale"] == "W8A8"
    assert verify(d).ok


def test_reader_errors_are_one_line(tmp_path, golden_copy):
    with pytest.raises(CheckpointError, match="no such folder"):
        read_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no quant_model_description.json"):
        read_checkpoint(fixture_dir("tiny-qwen2-fp32"))
    d = golden_copy("v1_w8a8_dyn")
    (d / "quant_model_description.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint(d)


@pytest.mark.parametrize("name", GOLDEN)
def test_round_trip_is_identical(name, tmp_path):
    src = read_checkpoint(fixture_dir(name))
    out = copy_checkpoint(src, tmp_path / "out")
    back = read_checkpoint(out)
    assert back.layout == "v1"
    assert back.description == src.description
    for key in ("model_quant_type", "version"):
        assert back.meta[key] == src.meta[key]
    assert back.group_size == src.group_size
    a, b = src.tensors(), back.tensors()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # the loader rules vllm-ascend depends on hold for what we wrote
    report = verify(out)
    assert report.ok, report.problems
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["quant_model_weights.safetensors"]
    desc = json.loads((out / "quant_model_description.json").read_text())
    linears = {n.rpartition(".")[0] for n in desc if n.endswith((".deq_scale", ".weight_scale"))}
    assert all(f"{p}.weight" in desc for p in linears)
    if (fixture_dir(name) / "tokenizer.json").exists():
        assert (out / "tokenizer.json").read_bytes() == (fixture_dir(name) / "tokenizer.json").read_bytes()
        assert (out / "config.json").exists()


def test_writer_shards_by_size_with_an_index(tmp_path):
    src = read_checkpoint(fixture_dir("v1_w8a8_dyn"))
    out = copy_checkpoint(src, tmp_path / "sharded", max_shard_size=300_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"quant_model_weights-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(src.description)
    back = read_checkpoint(out)
    assert back.layout == "v1-sharded" and verify(out).ok
    assert torch.equal(back.tensor("lm_head.weight"), src.tensor("lm_head.weight"))


def test_writer_is_atomic(tmp_path, monkeypatch):
    src = read_checkpoint(fixture_dir("v1_w8a8_dyn"))
    calls = []

    def failing_save(tensors, filename, *a, **k):
        calls.append(filename)
        raise KeyboardInterrupt   # as if the user pressed Ctrl-C mid-write

    monkeypatch.setattr(ascend, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        copy_checkpoint(src, tmp_path / "out")
    assert calls, "the writer never reached the weights"
    assert list(tmp_path.iterdir()) == []     # neither the folder nor a temp folder is left


def test_writer_refuses_to_clobber_and_replaces_when_asked(tmp_path):
    src = read_checkpoint(fixture_dir("v1_w8a8_dyn"))
    out = copy_checkpoint(src, tmp_path / "out")
    with pytest.raises(FileExistsError):
        copy_checkpoint(src, out)
    (out / "model.safetensors").write_bytes(b"stale float weights")
    copy_checkpoint(src, out, overwrite=True)
    assert not (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_writer_checks_description_against_tensors(tmp_path):
    with pytest.raises(ValueError, match="disagree"):
        write_checkpoint(tmp_path / "o", {"a.weight": torch.zeros(2)}, {"b.weight": "FLOAT"})
    with pytest.raises(ValueError, match="unknown quant type"):
        write_checkpoint(tmp_path / "o", {"a.weight": torch.zeros(2)}, {"a.weight": "W3A3"})
    assert not (tmp_path / "o").exists()


def test_description_top_level_keys():
    desc = ascend.build_description({"x.weight": "W8A8", "y.weight": "W8A8", "z.weight": "W4A8_DYNAMIC",
                                     "k.kv_cache_scale": "C8", "e.weight": "FLOAT"}, group_size=64)
    assert desc["model_quant_type"] == "W8A8" and desc["group_size"] == 64
    assert desc["kv_cache_type"] == "C8" and desc["version"] == "1.0.0"
    assert list(desc)[:3] == ["version", "model_quant_type", "group_size"]
