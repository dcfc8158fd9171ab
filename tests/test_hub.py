"""Publishing: the model card and `ascend-quant upload` through the real huggingface_hub
client against a loopback stand-in of the Hub (the real one is not reachable here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from ascend_quant.calibration import job, recipe as recipes
from hub_server import FakeHub

TOKEN = "hf_" + "S3cretT0kenForTests" * 2
CLI = [sys.executable, "-m", "ascend_quant.cli.main"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, reference_model):
    """The reference model (SmolLM2-135M from PyPI), calibrated quickly, evaluated, with a
    float weight file and a cache folder left beside it that must not be published."""
    out = tmp_path_factory.mktemp("hub") / "smollm2-w8a8"
    rec = recipes.preset("w8a8-dynamic")
    rec.method = "minmax"
    job.calibrate(str(reference_model), out, rec, num_samples=2, seq_len=64, show_progress=False)
    res = subprocess.run(CLI + ["eval", "--model", str(reference_model), "--quantized", str(out),
                                "--tokens", "512", "--seq-len", "128"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (out / "model.safetensors").write_bytes(b"float weights that must stay home")
    (out / ".cache").mkdir()
    (out / ".cache" / "blob").write_bytes(b"x")
    return out


def _env(hub_url: str, token: str | None = TOKEN) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_ENDPOINT"] = hub_url
    env["HF_HOME"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "ascend-quant-test-hf-home")
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    # hf_xet's chunked CAS protocol is not emulated by the stand-in: large files take the
    # library's git-LFS path (preupload -> LFS batch -> PUT -> commit), as without hf_xet.
    env["HF_HUB_DISABLE_XET"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return env


def _upload(folder, repo, env, *extra):
    return subprocess.run(CLI + ["upload", str(folder), repo, *extra], capture_output=True, text=True, env=env,
                          timeout=300)


def _listed(stdout: str) -> list[str]:
    listing = stdout.split("--- model card")[0]
    return sorted(line.split()[0] for line in listing.splitlines()
                  if line.startswith("  ") and not line.strip().startswith("skipped"))


def test_dry_run_and_upload_send_the_same_files(calibrated):
    with FakeHub() as hub:
        dry = _upload(calibrated, "acme/smollm2-w8a8", _env(hub.url), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert hub.requests == [] or all(r[1].startswith("/api/agent") for r in hub.requests)
        real = _upload(calibrated, "acme/smollm2-w8a8", _env(hub.url), "--commit-message", "first")
        assert real.returncode == 0, real.stderr
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    assert commit["repo"] == "acme/smollm2-w8a8" and commit["summary"] == "first"
    assert sorted(commit["files"]) == _listed(dry.stdout) == _listed(real.stdout)
    names = set(commit["files"])
    assert {"quant_model_description.json", "quant_model_weights.safetensors", "config.json",
            "tokenizer.json", "README.md"} <= names
    assert "model.safetensors" not in names and not any(n.startswith(".cache") for n in names)
    assert "skipped (not part of the checkpoint): model.safetensors" in dry.stdout
    assert commit["files"]["quant_model_weights.safetensors"] == (calibrated / "quant_model_weights.safetensors").read_bytes()
    assert "acme" in hub.repos or "acme/smollm2-w8a8" in hub.repos or hub.repos


def test_card_renders_and_matches_eval(calibrated):
    with FakeHub() as hub:
        res = _upload(calibrated, "acme/card", _env(hub.url))
        assert res.returncode == 0, res.stderr
    card_text = hub.commits[0]["files"]["README.md"].decode()
    assert hub.validated and hub.validated[0].startswith("---")     # the client validated the YAML header
    card = ModelCard(card_text)
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["license"] == "apache-2.0" and data["library_name"] == "vllm"
    assert {"ascend", "vllm", "quantized", "w8a8-dynamic"} <= set(data["tags"])
    evals = json.loads((calibrated / "eval_results.json").read_text())
    assert f"| float | {evals['float_ppl']:.4f} |" in card_text
    assert f"| W8A8_DYNAMIC | {evals['quantized_ppl']:.4f} | {evals['delta']:+.2%} |" in card_text
    assert "vllm serve acme/card --quantization ascend" in card_text
    assert "| `down_proj` | W8A8_DYNAMIC | int8 | int8 dynamic |" in card_text


def test_token_is_never_printed_or_published(calibrated):
    with FakeHub(token=TOKEN) as hub:
        ok = _upload(calibrated, "acme/secret", _env(hub.url))
        assert ok.returncode == 0, ok.stderr
        assert f"Bearer {TOKEN}" in hub.seen_auth            # the client did send it...
        bad = _upload(calibrated, "acme/secret", _env(hub.url, token=TOKEN[:-3] + "xyz"))
    for out in (ok.stdout, ok.stderr, bad.stdout, bad.stderr):
        assert TOKEN not in out and TOKEN[:-3] not in out   # ...but never shows it
    for content in hub.commits[0]["files"].values():
        assert TOKEN.encode() not in content
    assert bad.returncode == 1 and "HTTP 401" in bad.stderr and "HF_TOKEN" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "done:" not in bad.stdout
    assert len(hub.commits) == 1


def test_offline_is_one_clear_line(calibrated):
    with socket.socket() as s:                 # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _upload(calibrated, "acme/offline", _env(f"http://127.0.0.1:{port}"))
    assert res.returncode == 1
    assert "cannot reach the Hugging Face Hub" in res.stderr and "nothing was uploaded" in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "done:" not in res.stdout


def test_upload_of_a_non_checkpoint_fails_cleanly(tmp_path):
    res = _upload(tmp_path, "acme/empty", _env("http://127.0.0.1:9"), "--dry-run")
    assert res.returncode == 1 and "not an Ascend quantized checkpoint" in res.stderr
