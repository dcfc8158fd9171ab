"""benchmarks/calibration.py's default data: every tool gets, as text, the windows that
`ascend-quant calibrate` cuts with no flags."""

import importlib.util
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ascend_quant.assets import reference_model_dir, wiki_paragraphs

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration.py"
_SPEC = importlib.util.spec_from_file_location("calibration_benchmark", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_packed_texts_are_the_cli_default_windows():
    tok = AutoTokenizer.from_pretrained(str(reference_model_dir()))
    texts, same = bench.packed_texts(tok, 16, 512)
    assert len(texts) == 16
    # the oracle: the calibration split's paragraphs themselves. Each text is a piece of their
    # concatenation (seed-shuffled, end-of-text between them), so its opening words occur in one
    paragraphs = wiki_paragraphs("calibration")
    for text in texts:
        head = text.replace(tok.eos_token, "\n").strip().split("\n")[0][:60]
        assert any(head in p for p in paragraphs), head
    # and re-tokenized, nearly all are exactly 512 tokens (what calibrate feeds the model)
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert same >= 14 and sum(n == 512 for n in lengths) >= 14
    assert not torch.tensor(lengths).lt(500).any()


def test_paragraph_mode_is_still_there(tmp_path):
    data = bench.prepare_data(Path(reference_model_dir()), 4, 1024, 512, tmp_path, packed=False)
    lines = Path(data["calib_jsonl"]).read_text().splitlines()
    assert len(lines) == 4 and data["packed"] is False
    packed = bench.prepare_data(Path(reference_model_dir()), 4, 1024, 512, tmp_path / "p", packed=True)
    assert packed["calib_tokens"] > data["calib_tokens"] and packed["packed"] is True
