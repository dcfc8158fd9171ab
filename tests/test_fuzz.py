"""Seeded mutations of msModelSlim's files end in success or one clean error, everywhere.

Each case breaks a copy of a golden folder in one way (bit flips in a safetensors header or
data, truncation, header edits of offsets/shapes/dtypes, NaN/Inf/zero/negative scales,
description and config values changed, dropped or garbage, empty files, a bad shard index)
and runs it through `verify`, `inspect`, `convert` and the loader behind `serve`
(`AscendQuantConfig.maybe_update_config` plus the value checks). Allowed outcomes: success,
or an exception of ours with a one-line message (what the CLI turns into one `Error:` line);
convert leaves no folder behind when it fails. Mutations that plant a bad scale or a NaN
must also be *rejected* by verify, convert and the loader, naming the file and tensor.

Cases are built from bytes held in memory: unchanged files are hard links to one pristine
copy per fixture, so a case costs only the files it changes. A failure prints the case
label; rerun with the same seed to get the same case.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from ascend_quant.cli.main import cli
from ascend_quant.formats.ascend import CheckpointError, read_checkpoint
from ascend_quant.formats.checks import SCALE_SUFFIXES, checkpoint_value_problems
from ascend_quant.formats.convert import ConversionError, convert
from ascend_quant.formats.inspect import format_summary, summarize
from ascend_quant.formats.verify import verify
from conftest import GOLDEN, REPO, fixture_dir

SEED = int(os.environ.get("ASCEND_QUANT_FUZZ_SEED", "13"))
CASES_PER_FIXTURE = int(os.environ.get("ASCEND_QUANT_FUZZ_CASES", "150"))     # 900 cases, ~15 s
_ST_FORMATS = {"F32": "<f", "F64": "<d", "I64": "<q", "I32": "<i", "I8": "<b"}


@dataclass
class Case:
    label: str
    changes: dict[str, bytes | None]          # file name -> new bytes (None: delete the file)
    reject: tuple[str, str] | None = None     # (file, tensor) that must be refused ...
    reject_in: tuple[str, ...] = ("verify", "convert", "loader")   # ... by these entry points


# ------------------------------------------------------------------ safetensors bytes

def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob + body


def _tensors(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _set_element(data: bytes, name: str, index: int, value: float) -> bytes:
    """`data` with element `index` of tensor `name` set to `value` (an int64 deq_scale gets
    the float32 bits of it, as msModelSlim encodes them)."""
    header, body = _split(data)
    info = header[name]
    start = info["data_offsets"][0]
    if info["dtype"] == "I64":
        raw = struct.pack("<q", struct.unpack("<I", struct.pack("<f", value))[0])
    else:
        raw = struct.pack(_ST_FORMATS[info["dtype"]], value)
    at = start + index * len(raw)
    body = body[:at] + raw + body[at + len(raw):]
    return data[:len(data) - len(body)] + body


# ------------------------------------------------------------------ mutations

class Mutator:
    """Draws one mutation of one golden folder per call, from its pristine bytes."""

    def __init__(self, files: dict[str, bytes], rng: random.Random):
        self.files = files
        self.rng = rng
        self.weights = sorted(f for f in files if f.endswith(".safetensors"))
        self.desc = next(f for f in files if f.startswith("quant_model_description"))
        self.headers = {f: _split(files[f])[0] for f in self.weights}
        self.described = json.loads(files[self.desc])

    def case(self) -> Case:
        """One mutation; one case in ten stacks two (what is refused then is not pinned down)."""
        if self.rng.random() < 0.1:
            first, second = self.one(), self.one()
            return Case(f"{first.label} + {second.label}", {**first.changes, **second.changes})
        return self.one()

    def one(self) -> Case:
        kinds = [(self.bitflip, 14), (self.truncate, 8), (self.header_edit, 14), (self.bad_scale, 16),
                 (self.bad_float, 6), (self.bad_value, 4), (self.reshape_weight, 6), (self.description, 12),
                 (self.config, 6), (self.empty_file, 4), (self.index, 10)]
        pick = self.rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
        return pick()

    # -- helpers
    def _file(self) -> str:
        return self.rng.choice(self.weights)

    def _tensor(self, want=lambda name, info: True) -> tuple[str, str] | None:
        pairs = [(f, n) for f in self.weights for n in _tensors(self.headers[f]) if want(n, self.headers[f][n])]
        return self.rng.choice(pairs) if pairs else None

    # -- safetensors bytes
    def bitflip(self) -> Case:
        f = self._file()
        data = bytearray(self.files[f])
        hlen = int.from_bytes(data[:8], "little")
        where = self.rng.choice(["length", "header", "data"])
        lo, hi = {"length": (0, 8), "header": (8, 8 + hlen), "data": (8 + hlen, len(data))}[where]
        flips = self.rng.randint(1, 4)
        for _ in range(flips):
            data[self.rng.randrange(lo, hi)] ^= 1 << self.rng.randrange(8)
        return Case(f"bitflip {where} x{flips} {f}", {f: bytes(data)})

    def truncate(self) -> Case:
        f = self._file()
        data = self.files[f]
        header_end = 8 + int.from_bytes(data[:8], "little")
        cut = self.rng.choice([0, self.rng.randrange(1, 8), self.rng.randrange(8, header_end),
                               self.rng.randrange(len(data) // 2, len(data))])
        return Case(f"truncate {f} at {cut}", {f: data[:cut]})

    def header_edit(self) -> Case:
        f = self._file()
        header, body = _split(self.files[f])
        name = self.rng.choice(_tensors(header))
        info = header[name]
        field_, r = self.rng.choice(["data_offsets", "shape", "dtype", "extra"]), self.rng
        if field_ == "data_offsets":
            s, e = info["data_offsets"]
            info["data_offsets"] = r.choice([[s + 1, e], [s, e - 1], [e, s], [s, len(body) + 8], [-1, e],
                                             [s, e + 2 ** 40], [0, 0], "garbage", [s]])
        elif field_ == "shape":
            shape = info["shape"]
            info["shape"] = r.choice([shape[::-1], shape + [1], shape[:-1], [d + 1 for d in shape], [0] * len(shape),
                                      [-1] + shape[1:], [2 ** 62, 2 ** 62], "x", [1.5]])
        elif field_ == "dtype":
            info["dtype"] = r.choice(["F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL", "F64", "F8_E4M3",
                                      "Q4", "", 5])
        else:
            header[r.choice(["__metadata__", name + "_copy"])] = r.choice([{"a": 1}, "x", dict(info), None])
        return Case(f"header {field_} of {name} in {f} -> {str(info.get(field_, ''))[:40]}", {f: _join(header, body)})

    def bad_scale(self) -> Case:
        """A NaN, Inf, zero or negative element in a scale: every entry point must refuse it."""
        picked = self._tensor(lambda n, i: n.rpartition(".")[2] in SCALE_SUFFIXES and i["dtype"] in ("F32", "I64"))
        value = self.rng.choice([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1e-3, -5.0])
        return self._plant(picked, value, "scale")

    def bad_float(self) -> Case:
        """NaN/Inf in a FLOAT tensor (embedding, norm, bias) or an offset: must be refused too."""
        picked = self._tensor(lambda n, i: i["dtype"] == "F32" and n.rpartition(".")[2] not in SCALE_SUFFIXES
                              and (self.described.get(n) == "FLOAT" or n.endswith(("_offset", "scale_bias"))))
        return self._plant(picked, self.rng.choice([float("nan"), float("inf"), float("-inf")]), "float")

    def _plant(self, picked: tuple[str, str], value: float, what: str) -> Case:
        f, name = picked
        info = self.headers[f][name]
        numel = 1
        for d in info["shape"]:
            numel *= d
        index = self.rng.randrange(max(numel, 1))
        return Case(f"{what} {name}[{index}] = {value} in {f}", {f: _set_element(self.files[f], name, index, value)},
                    reject=(f, name))

    def bad_value(self) -> Case:
        """Values that are wrong without being NaN: a non-integral zero point, an int64 deq_scale
        with bits above float32's, a float quant_bias."""
        picked = self._tensor(lambda n, i: n.endswith((".input_offset", ".deq_scale")))
        if picked is None:
            return self.bad_scale()
        f, name = picked
        info = self.headers[f][name]
        if name.endswith("input_offset"):
            value = self.rng.choice([0.5, 300.0, -129.0])
            return Case(f"offset {name} = {value}", {f: _set_element(self.files[f], name, 0, value)}, reject=(f, name))
        if info["dtype"] != "I64":
            return self.bad_scale()
        header, body = _split(self.files[f])
        start = info["data_offsets"][0]
        body = body[:start] + struct.pack("<q", 1 << 40) + body[start + 8:]
        return Case(f"deq_scale {name} holds 2**40", {f: _join(header, body)}, reject=(f, name))

    def reshape_weight(self) -> Case:
        """Another 2-D factorisation of a quantized weight: the file stays valid, the layer does not."""
        picked = self._tensor(lambda n, i: n.endswith(".weight") and i["dtype"] == "I8" and len(i["shape"]) == 2)
        f, name = picked
        header, body = _split(self.files[f])
        a, b = header[name]["shape"]
        header[name]["shape"] = self.rng.choice([[a * 2, b // 2], [a // 2, b * 2], [b, a]] if a != b else
                                                [[a * 2, b // 2], [a // 2, b * 2]])
        # verify names a packed int4 weight of the wrong shape; convert copies it and vLLM's
        # loader refuses it on the parameter's shape, so only verify is held to it here
        return Case(f"reshape {name} {[a, b]} -> {header[name]['shape']}", {f: _join(header, body)},
                    reject=(f, name) if self.described.get(name, "").startswith("W4") else None,
                    reject_in=("verify",))

    # -- JSON files
    def description(self) -> Case:
        r = self.rng
        desc = dict(self.described)
        keys = [k for k in desc if "." in k]
        key = r.choice(keys)
        edit = r.choice(["drop", "value", "top", "add", "whole", "rename"])
        if edit == "drop":
            del desc[r.choice(keys + ["model_quant_type", "group_size"])]
        elif edit == "value":
            desc[key] = r.choice(["W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC", "C8", "FLOAT", "W2A2",
                                  "", 7, None, ["W8A8"], {"a": 1}, True])
        elif edit == "top":
            top = r.choice(["group_size", "model_quant_type", "kv_cache_type", "metadata", "optional", "version"])
            desc[top] = r.choice(["x", -1, 1.5, 10 ** 30, [], {}, None, True, 0, 3, "C8"])
        elif edit == "add":
            desc[r.choice(["model.layers.7.mlp.up_proj.weight", "model.layers.99999999999.x.weight",
                           "model.layers.0.{x}.weight", "x", ""])] = r.choice(["W8A8", "FLOAT", "C8"])
        elif edit == "rename":
            desc[key + "_"] = desc.pop(key)
        else:
            raw = r.choice([b"[]", b"[1, 2]", b"42", b'"text"', b"null", b"{", b"\xff\xfe\x00garbage", b"",
                            json.dumps(desc).encode()[: r.randrange(1, 200)], b"[" * 100000])
            return Case(f"description is {raw[:20]!r}", {self.desc: raw})
        return Case(f"description {edit} {key}", {self.desc: json.dumps(desc).encode()})

    def config(self) -> Case:
        if "config.json" not in self.files:
            return self.description()
        r = self.rng
        cfg = json.loads(self.files["config.json"])
        key = r.choice(["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                        "dtype", "torch_dtype", "text_config", "quantization_config", "whole"])
        if key == "whole":
            raw = r.choice([b"[]", b"3", b"{", b"", b"\x00\x01"])
            return Case(f"config.json is {raw!r}", {"config.json": raw})
        cfg[key] = r.choice([0, -2, 10 ** 12, "x", None, 1.5, [], {"quant_method": "ascend"}, "bfloat16", "float16"])
        return Case(f"config.json {key} = {cfg[key]!r}", {"config.json": json.dumps(cfg).encode()})

    def empty_file(self) -> Case:
        f = self.rng.choice(sorted(self.files))
        if self.rng.random() < 0.5:
            return Case(f"delete {f}", {f: None})
        return Case(f"empty {f}", {f: b""})

    def index(self) -> Case:
        r = self.rng
        names = [n for f in self.weights for n in _tensors(self.headers[f])]
        shard = self.weights[0]
        weight_map = {n: shard for n in names}
        edit = r.choice(["list", "number", "garbage", "map-list", "missing-shard", "wrong-names", "non-string",
                         "outside", "drop-entries", "extra-shard", "duplicate-shard"])
        changes: dict[str, bytes | None] = {}
        if edit == "list":
            index = [weight_map]
        elif edit == "number":
            index = 3.5
        elif edit == "garbage":
            index = None
            changes["_raw"] = b"{\"weight_map\": {"
        elif edit == "map-list":
            index = {"weight_map": list(weight_map.items())}
        elif edit == "missing-shard":
            index = {"weight_map": {**weight_map, names[0]: "quant_model_weights-00002-of-00002.safetensors"}}
        elif edit == "wrong-names":
            index = {"weight_map": {n + ".renamed": s for n, s in weight_map.items()}}
        elif edit == "non-string":
            index = {"weight_map": {**weight_map, names[0]: r.choice([1, None, [shard]])}}
        elif edit == "outside":
            index = {"weight_map": {**weight_map, names[0]: r.choice(["../" + shard, "/etc/passwd", "config.json"])}}
        elif edit == "drop-entries":
            index = {"weight_map": dict(list(weight_map.items())[::2])}
        else:       # a second shard that repeats a tensor, or one the index does not name
            second = "quant_model_weights-00002-of-00002.safetensors"
            header, body = _split(self.files[shard])
            name = r.choice(names)
            info = header[name]
            s, e = info["data_offsets"]
            changes[second] = _join({name: {**info, "data_offsets": [0, e - s]}}, body[s:e])
            extra = {name + ".twin": second} if edit == "extra-shard" else {}
            index = {"weight_map": {**weight_map, **extra, name: second if edit == "duplicate-shard" else shard}}
        target = next((f for f in self.files if f.endswith(".index.json")), None)
        if target is None:       # not sharded: an index still takes over which files are read
            target = "quant_model_weights.safetensors.index.json"
        raw = changes.pop("_raw", None) or json.dumps(index).encode()
        changes[target] = raw
        return Case(f"index {edit}", changes)


# ------------------------------------------------------------------ outcomes

def _clean(message: str) -> bool:
    return bool(message) and "\n" not in message and "Traceback" not in message


def _crash(entry: str, e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{entry}: {type(e).__name__}: {str(e)[:200]} (at {Path(frame.filename).name}:{frame.lineno})"


def _run_case(folder: Path, out_parent: Path, case: Case, loader) -> list[str]:
    """Every entry point on one mutated folder; the failures of the contract, as lines."""
    failures = []
    must_reject = case.reject_in if case.reject else ()
    # verify: never raises; every problem is one line
    try:
        report = verify(folder)
        bad = [p for p in report.problems if not _clean(p)]
        if bad:
            failures.append(f"verify: multi-line problem {bad[0][:200]!r}")
        if "verify" in must_reject and not any(p.startswith(f"{case.reject[0]}: ") and case.reject[1] in p
                                   for p in report.problems):
            failures.append(f"verify accepted {case.reject[1]} in {case.reject[0]}: {report.problems[:3]}")
        json.dumps(report.as_dict())
    except Exception as e:  # noqa: BLE001 (any escape is the bug under test)
        failures.append(_crash("verify", e))
    # inspect: the table and the JSON, or one CheckpointError line
    try:
        summary = summarize(read_checkpoint(folder))
        format_summary(summary)
        json.dumps(summary)
    except CheckpointError as e:
        if not _clean(str(e)):
            failures.append(f"inspect: multi-line error {str(e)[:200]!r}")
    except Exception as e:  # noqa: BLE001
        failures.append(_crash("inspect", e))
    # convert, to both targets: a whole folder or one ConversionError line and nothing written
    side = None if (folder / "config.json").exists() else fixture_dir("tiny-qwen2-fp32")
    for to, kwargs in (("ascend-v1", {}), ("compressed-tensors", {"drop_kv_cache": True, "config_from": side})):
        failures += _convert_case(folder, out_parent, case, to, kwargs, "convert" in must_reject)
    # the loader behind serve: vLLM's config hook, then the value checks before any weight is used
    try:
        loader().maybe_update_config(str(folder))
        problems = list(checkpoint_value_problems(read_checkpoint(folder)))
        if "loader" in must_reject and not any(case.reject[1] in p for p in problems):
            failures.append(f"loader accepted {case.reject[1]}")
    except ValueError as e:
        if not _clean(str(e)):
            failures.append(f"loader: multi-line error {str(e)[:200]!r}")
    except CheckpointError as e:     # maybe_update_config read it fine, the second read must too
        failures.append(f"loader: second read failed: {e}")
    except Exception as e:  # noqa: BLE001
        failures.append(_crash("loader", e))
    return failures


def _convert_case(folder: Path, out_parent: Path, case: Case, to: str, kwargs: dict, must_reject: bool) -> list[str]:
    failures = []
    out = out_parent / "out"
    try:
        convert(folder, out, to=to, **kwargs)
        if must_reject:
            failures.append(f"convert --to {to} accepted {case.reject[1]}")
        left = sorted(p.name for p in out_parent.iterdir())
        if left != ["out"]:
            failures.append(f"convert --to {to} succeeded but left {left}")
    except ConversionError as e:
        if not _clean(str(e)):
            failures.append(f"convert --to {to}: multi-line error {str(e)[:200]!r}")
        if must_reject and case.reject[1] not in str(e):
            failures.append(f"convert --to {to} refused, but not for {case.reject[1]}: {str(e)[:200]}")
        left = sorted(p.name for p in out_parent.iterdir())
        if left:
            failures.append(f"convert --to {to} failed but left {left}")
    except Exception as e:  # noqa: BLE001
        failures.append(_crash(f"convert --to {to}", e))
    shutil.rmtree(out, ignore_errors=True)
    return failures


def _materialize(pristine: Path, folder: Path, changes: dict[str, bytes | None]) -> None:
    folder.mkdir()
    for f in pristine.iterdir():
        if f.name not in changes:
            os.link(f, folder / f.name)
    for name, data in changes.items():
        if data is not None:
            (folder / name).write_bytes(data)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tensors here are tiny: torch's thread pool costs more than it saves (5x on 2 shared cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loader():
    from ascend_quant.runtime.vllm.config import AscendQuantConfig    # imports vllm: a broken install fails here
    return AscendQuantConfig


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GOLDEN)
def test_mutated_fixtures_end_cleanly(name, tmp_path, loader):
    """CASES_PER_FIXTURE seeded cases of one fixture through every entry point; all failures of
    the contract are listed together, with their case labels."""
    pristine = tmp_path / "pristine"
    shutil.copytree(fixture_dir(name), pristine)
    files = {f.name: f.read_bytes() for f in pristine.iterdir()}
    mutator = Mutator(files, random.Random(f"{SEED}-{name}"))
    failures, rejected = [], 0
    start = time.monotonic()
    for i in range(CASES_PER_FIXTURE):
        case = mutator.case()
        folder, out_parent = tmp_path / f"case{i}", tmp_path / f"out{i}"
        _materialize(pristine, folder, case.changes)
        out_parent.mkdir()
        failures += [f"case {i} ({case.label}): {f}" for f in _run_case(folder, out_parent, case, loader)]
        rejected += case.reject is not None
        shutil.rmtree(folder)
        shutil.rmtree(out_parent)
    print(f"{name}: {CASES_PER_FIXTURE} cases ({rejected} must-reject) in {time.monotonic() - start:.1f}s")
    assert not failures, f"seed {SEED}, {len(failures)} failure(s):\n" + "\n".join(failures[:40])
    assert rejected >= CASES_PER_FIXTURE // 8      # the bad-scale cases were drawn, not skipped


# ------------------------------------------------------------------ the CLI contract

def _cli_cases(name: str, tmp_path: Path, count: int) -> list[tuple[Case, Path]]:
    """`count` mutated copies of a fixture from their own seeded stream, the first one a bad scale."""
    files = {f.name: f.read_bytes() for f in fixture_dir(name).iterdir()}
    mutator = Mutator(files, random.Random(f"{SEED}-cli-{name}"))
    cases = [mutator.bad_scale()] + [mutator.case() for _ in range(count - 1)]
    out = []
    for i, case in enumerate(cases):
        folder = tmp_path / f"{name}-{i}"
        folder.mkdir()
        for f, data in files.items():
            if f not in case.changes:
                (folder / f).write_bytes(data)
        for f, data in case.changes.items():
            if data is not None:
                (folder / f).write_bytes(data)
        out.append((case, folder))
    return out


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


@pytest.mark.timeout(120)
def test_cli_contract_on_mutated_fixtures(tmp_path):
    """In-process CLI on 4 mutated copies of each fixture: exit 0 or 1, never an exception;
    `--json` is one JSON document on stdout; a failing inspect/convert is one `Error:` line on
    stderr and leaves no output folder; verify names the planted bad scale."""
    runner = CliRunner()
    for name in GOLDEN:
        for case, folder in _cli_cases(name, tmp_path, 4):
            where = f"{name} ({case.label})"
            results = {cmd: runner.invoke(cli, [*cmd.split(), str(folder)]) for cmd in
                       ("verify", "verify --json", "inspect", "inspect --json")}
            out = tmp_path / "OUT"
            results["convert"] = runner.invoke(cli, ["convert", str(folder), "-o", str(out)])
            for cmd, r in results.items():
                assert r.exit_code in (0, 1) and (r.exception is None or isinstance(r.exception, SystemExit)), \
                    f"{where}: {cmd}: {r.exception!r}"
            report = json.loads(results["verify --json"].stdout)
            assert report["ok"] == (results["verify --json"].exit_code == 0), where
            assert results["verify"].exit_code == results["verify --json"].exit_code, where
            errors = results["verify"].stderr.splitlines()
            assert all(line.startswith("error: ") for line in errors), where
            if case.reject:
                file, tensor = case.reject
                assert any(line.startswith(f"error: {file}: {tensor} ") for line in errors), (where, errors)
                assert results["convert"].exit_code == 1, where
            for cmd in ("inspect", "inspect --json", "convert"):
                r = results[cmd]
                if r.exit_code:
                    _error_line(r.stderr)
                    assert r.stdout == "", (where, cmd, r.stdout)
            if results["inspect --json"].exit_code == 0:
                json.loads(results["inspect --json"].stdout)
            if results["convert"].exit_code:
                assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(tuple(GOLDEN))) == [], where
            shutil.rmtree(out, ignore_errors=True)


@pytest.mark.timeout(120)
def test_real_cli_exit_codes_and_single_error_lines(tmp_path):
    """The installed command, as a user runs it: a NaN scale is refused naming file and tensor,
    and a shard index that holds a JSON list is one `Error:` line, not a traceback."""
    (case, nan_folder), = _cli_cases("v1_w8a8_static_c8", tmp_path, 1)
    listed = tmp_path / "listed"
    shutil.copytree(fixture_dir("v1_w8a8_static_c8"), listed)
    index = listed / "quant_model_weights.safetensors.index.json"
    index.chmod(0o644)
    index.write_text(json.dumps([json.loads(index.read_text())]))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "ascend_quant.cli.main", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=60)

    r = run("verify", nan_folder)
    file, tensor = case.reject
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith(f"error: {file}: {tensor} ")], r.stderr
    for args in (("verify", "--json", listed), ("inspect", "--json", listed), ("convert", listed, "-o",
                                                                               tmp_path / "OUT")):
        r = run(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        if args[1] == "--json" and args[0] == "verify":
            assert "expected a JSON object, found a list" in json.loads(r.stdout)["problems"][0]
        else:
            assert "expected a JSON object, found a list" in _error_line(r.stderr) and r.stdout == ""
    assert not (tmp_path / "OUT").exists()
