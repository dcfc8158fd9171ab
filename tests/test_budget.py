"""The quality budget (`calibrate --max-ppl-increase`, calibration/budget.py) on a tiny Llama
trained in the test, one of whose Linears is made very sensitive by an exact rescaling."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from ascend_quant.calibration.data import load_texts, tokenize_samples
from ascend_quant.cli.main import cli
from ascend_quant.formats.ascend import read_checkpoint
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from conftest import FIXTURES, add_tiny_tokenizer

SAMPLES, SEQ = 16, 64
OUTLIER = 30.0


@pytest.fixture(scope="module")
def calib_jsonl():
    return str(FIXTURES / "calib.jsonl")


@pytest.fixture(scope="module")
def plain_w4a16(tmp_path_factory):
    """W4A16 min-max, symmetric, unrotated, no AWQ: the outlier below stays an outlier (the
    preset's AWQ and rotation would spread it, and there would be nothing left to keep)."""
    path = tmp_path_factory.mktemp("recipe") / "w4a16-minmax.yaml"
    path.write_text("scheme: w4a16\nmethod: minmax\nrotation: null\nawq: null\nweights: {symmetric: true}\n")
    return str(path)


@pytest.fixture(scope="module")
def sensitive(tmp_path_factory, calib_jsonl):
    """A 2-layer Llama fitted to the calibration text, then layer 0's up_proj row 5 divided by
    OUTLIER and down_proj column 5 multiplied by it: the same function (silu(gate) * up is
    linear in up), but down_proj's int4 rows now hold one huge weight each, so round-to-nearest
    zeroes the rest of them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = add_tiny_tokenizer(tmp_path_factory.mktemp("sensitive"))
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = LlamaForCausalLM(cfg)
    ids = torch.cat([torch.tensor(tok(t)["input_ids"] + [2]) for t in load_texts(calib_jsonl)])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):
        starts = torch.randint(0, ids.numel() - SEQ, (8,))
        batch = torch.stack([ids[s:s + SEQ] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        mlp = model.model.layers[0].mlp
        mlp.up_proj.weight[5] /= OUTLIER
        mlp.down_proj.weight[:, 5] *= OUTLIER
    model.save_pretrained(folder)
    return folder


def _run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def _held_out(model_dir, calib_jsonl, samples: int = SAMPLES) -> torch.Tensor:
    """The held-out rows as the budget's documentation says: the last quarter of the packed
    calibration windows (tokenized here on their own)."""
    from transformers import AutoTokenizer
    s = tokenize_samples(load_texts(calib_jsonl), AutoTokenizer.from_pretrained(model_dir), samples, SEQ)
    return s.ids[-max(1, round(s.ids.shape[0] / 4)):]


@torch.no_grad()
def _nll(model, ids: torch.Tensor) -> float:
    logits = model(input_ids=ids).logits.float()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   ids[:, 1:].reshape(-1)))


def _increase(ckpt, model_dir, held, kv_cache: bool = False) -> float:
    from transformers import AutoModelForCausalLM
    float_nll = _nll(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), held)
    return 100 * (math.exp(_nll(load_reference_model(ckpt, kv_cache=kv_cache), held) - float_nll) - 1)


def test_budget_keeps_the_sensitive_group_and_meets_the_budget(tmp_path, sensitive, calib_jsonl, plain_w4a16):
    common = ["--recipe", plain_w4a16, "--dataset", calib_jsonl, "--num-samples", str(SAMPLES),
              "--seq-len", str(SEQ), "--threads", "1"]
    plain = tmp_path / "plain"
    assert _run(["calibrate", str(sensitive), "-o", str(plain), *common]).exit_code == 0
    held = _held_out(sensitive, calib_jsonl)
    plain_increase = _increase(plain, sensitive, held)
    budget = plain_increase / 4             # the outlier must go to W8A8_DYNAMIC to meet it
    out = tmp_path / "budget"
    res = _run(["calibrate", str(sensitive), "-o", str(out), *common, "--max-ppl-increase", f"{budget:.4f}"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "ascend_quant_calibration.json").read_text())["budget"]
    kept = record["kept"]
    assert kept and (kept[0]["layer"], kept[0]["group"]) == (0, "down"), kept
    assert len(kept) == 1, kept
    # the written checkpoint: verifies, the kept Linears are W8A8_DYNAMIC, the rest W4A16
    assert verify(out).ok
    description = read_checkpoint(out).description
    kept_linears = {n for c in kept for n in c["linears"]}
    for n in kept_linears:
        assert description[f"{n}.weight"] == "W8A8_DYNAMIC"
    assert description["model.layers.1.mlp.down_proj.weight"] == "W4A16"
    model = load_reference_model(out)
    for n in kept_linears:
        assert model.get_submodule(n).qlinear.scheme.name == "W8A8_DYNAMIC"
    # measured independently through the reference model on the held-out rows
    written = _increase(out, sensitive, held)
    assert written <= budget * 1.001 + 1e-6, (written, budget)
    assert abs(written - record["after"]["increase_pct"]) < 0.01 + 1e-3 * abs(written)
    assert record["size"]["bytes"] < record["size"]["float_bytes"]
    assert "quality budget" in res.output and "down_proj" in res.output


@pytest.mark.parametrize("kv", [False, True])
def test_budget_json_is_one_document(tmp_path, sensitive, calib_jsonl, kv):
    out = tmp_path / "q"
    res = CliRunner().invoke(cli, [
        "calibrate", str(sensitive), "-o", str(out), "--scheme", "w8a8-dynamic", "--dataset", calib_jsonl,
        "--num-samples", "8", "--seq-len", str(SEQ), "--threads", "1", "--max-ppl-increase", "50", "--json",
        *(["--kv-cache", "int8"] if kv else [])], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["budget"]["fallback"] == "FLOAT" and data["budget"]["after"]["increase_pct"] <= 50
    assert data["num_samples"] == 6          # 2 of 8 rows held out
    # the preset rotates this Llama: the mixed model, the reloads and the written checkpoint alike
    assert json.loads((out / "ascend_quant_calibration.json").read_text())["rotation"]["kind"] == "hadamard"
    # the smoothed W8A8_DYNAMIC checkpoint (factors folded into norms and up_proj rows; C8 too)
    # scored by the reference model equals what the budget's mixed-model simulation reported
    written = _increase(out, sensitive, _held_out(sensitive, calib_jsonl, 8), kv_cache=kv)
    assert abs(written - data["budget"]["after"]["increase_pct"]) < 0.01 + 1e-3 * abs(written)


@pytest.mark.parametrize("args, message", [
    (["--max-ppl-increase", "0"], "must be a positive percentage"),
    (["--max-ppl-increase", "-1"], "must be a positive percentage"),
    (["--max-ppl-increase", "nan"], "must be a positive percentage"),
    (["--max-ppl-increase", "1", "--fallback-scheme", "w4a8"], "is not more precise than W4A16"),
    (["--fallback-scheme", "float"], "give --max-ppl-increase too"),
    (["--max-ppl-increase", "1e-6"], "is unreachable"),
])
def test_bad_budget_is_one_error_line(tmp_path, sensitive, calib_jsonl, plain_w4a16, args, message):
    out = tmp_path / "q"
    res = CliRunner().invoke(cli, [
        "calibrate", str(sensitive), "-o", str(out), "--recipe", plain_w4a16, "--dataset",
        calib_jsonl, "--num-samples", "8", "--seq-len", str(SEQ), "--threads", "1", *args], catch_exceptions=False)
    assert res.exit_code == 1
    lines = [line for line in res.stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not out.exists()
