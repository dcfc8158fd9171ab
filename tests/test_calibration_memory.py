"""The calibrator's memory: a streamed calibration holds about one decoder layer, not the model.

`ascend-quant calibrate` runs in a child process whose anonymous RSS (RssAnon: heap and
anonymous mappings, not the pages of memory-mapped files) is sampled from /proc. Its peak
over a floor (a child that imports what calibration imports, loads the tokenizer and reads
the texts) is set
against one decoder layer's float bytes, read from the safetensors header. The models are
built here so that their decoder layers are most of the model and the activations are small
(few short samples, a small vocabulary): whatever grows with the number of layers (float
layers kept, quantized weights of finished layers held until the end) shows as many layers'
worth. The llama is calibrated rotated: a rotation must not need the whole model either.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, add_tiny_tokenizer

LAYERS = 24
# layers' worth of anonymous memory over the floor a calibration may use: the layer being
# calibrated (its float weights, their fake-quantized copy, the rounding's temporaries: about 4
# for the llama here, 2 for the mixtral) and allocator slack. Holding every finished layer's
# int8 weights until the end adds LAYERS / 4 = 6 (measured: 8.7 and 8.0 layers' worth).
MAX_LAYERS_WORTH = 6.0


def _config(family: str):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=512, hidden_size=512, num_hidden_layers=LAYERS, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if family == "llama":
        return LlamaConfig(intermediate_size=2048, **common)
    return MixtralConfig(intermediate_size=512, num_local_experts=4, num_experts_per_tok=2, **common)


def _build(family: str, dst: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    model.save_pretrained(dst, safe_serialization=True)
    add_tiny_tokenizer(dst)
    return dst


def _layer0_bytes(folder: Path) -> int:
    """Bytes of decoder layer 0 in the safetensors file (from its header)."""
    with (folder / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
               if k.startswith("model.layers.0."))


def _peak_anon(cmd: list[str]) -> int:
    """Run `cmd`; the peak RssAnon (bytes) sampled from /proc every few ms while it runs."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while p.poll() is None:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:                   # just ended
            break
        anon = next((line for line in status.splitlines() if line.startswith("RssAnon:")), None)
        if anon is not None:
            peak = max(peak, int(anon.split()[1]) * 1024)
        time.sleep(0.005)
    err = p.stderr.read()
    p.wait()
    assert p.returncode == 0, err[-2000:]
    return peak


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_streamed_calibration_peak_is_about_one_layer(tmp_path, family):
    model = _build(family, tmp_path / family)
    try:
        _check_peak(tmp_path, model, family)
    finally:                              # the folders are large: not kept with pytest's last runs
        for folder in (model, tmp_path / "q"):
            shutil.rmtree(folder, ignore_errors=True)


def _check_peak(tmp_path: Path, model: Path, family: str) -> None:
    layer = _layer0_bytes(model)
    py = sys.executable
    data = str(FIXTURES / "calib.jsonl")
    floor = _peak_anon([py, "-c", "import sys, time, torch, transformers, ascend_quant.calibration.job; "
                        "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(sys.argv[1]); "
                        "from ascend_quant.calibration.data import load_texts; load_texts(sys.argv[2], 'calibration'); "
                        "time.sleep(0.5)", str(model), data])
    peak = _peak_anon([py, "-m", "ascend_quant.cli.main", "calibrate", str(model), "-o", str(tmp_path / "q"),
                       "--scheme", "w8a8-dynamic", "--method", "minmax", "--dataset", data,
                       "--num-samples", "2", "--seq-len", "32", "--threads", "1",
                       # the llama is rotated too (each tensor as it is read), the MoE cannot be
                       *(["--rotate"] if family == "llama" else ["--no-rotate"])])
    assert (tmp_path / "q" / "quant_model_weights.safetensors").is_file()
    worth = (peak - floor) / layer
    model_layers = LAYERS * layer
    assert worth < MAX_LAYERS_WORTH, (f"{family}: calibration's anonymous peak is {(peak - floor) / 2**20:.1f} MiB over "
                                      f"the floor = {worth:.1f} layers' worth (one layer {layer / 2**20:.1f} MiB, "
                                      f"the layers {model_layers / 2**20:.0f} MiB)")
