"""The commands that run vLLM as a user does, in subprocesses: `serve` (safe defaults:
loopback, the folder's name, the key passed through and never printed; one real server shared
by the tests, msModelSlim's W8A8_DYNAMIC fixture in vLLM's default compile mode, no
--enforce-eager) and `eval --json --vllm` (one JSON document on stdout, exit status 0).

Starting vLLM's server takes ~60 s on 2 cores, so `server` runs once per module; its last
test stops it by the PID `serve` prints, as the README says to.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from ascend_quant.cli.serve import _example_request, _redacted, _url, _vllm_command
from conftest import fixture_dir

KEY = "sk-test-" + secrets.token_hex(12)
FOLDER = "v1_w8a8_dyn"
START_S = 420


# ----------------------------------------------------------------------------- the command

def test_defaults_fill_only_what_the_user_left_out():
    cmd = _vllm_command("/data/out/my-model", ("--port", "9000"))
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--served-model-name") + 1] == "my-model"
    assert cmd[cmd.index("--quantization") + 1] == "ascend"
    assert "--enforce-eager" not in cmd                 # vLLM's default compile mode stays
    assert _url(cmd) == ("http://127.0.0.1:9000", False)

    mine = _vllm_command("/data/out/my-model", ("--host=0.0.0.0", "--served_model_name", "prod", "-q", "ascend_quant"))
    assert "127.0.0.1" not in mine and "my-model" not in mine and "--quantization" not in mine
    assert _url(mine) == ("http://127.0.0.1:8000", True)   # reached on loopback, exposed to others


def test_the_key_is_passed_through_and_never_printed():
    cmd = _vllm_command("/data/out/m", ("--api-key", KEY, "second-key", "--dtype", "float32"))
    assert cmd[cmd.index("--api-key") + 1] == KEY       # vLLM gets it unchanged
    shown = _redacted(cmd) + _redacted(_vllm_command("/m", (f"--api-key={KEY}",)))
    assert KEY not in shown and "second-key" not in shown and "--dtype float32" in shown
    example = _example_request("http://127.0.0.1:8000", "m", keyed=True)
    assert '"Authorization: Bearer $VLLM_API_KEY"' in example and KEY not in example
    assert "Authorization" not in _example_request("http://127.0.0.1:8000", "m", keyed=False)


def test_a_failing_vllm_start_is_the_exit_status(tmp_path):
    """vLLM rejects an unknown option (argparse: status 2): `serve` ends with that status."""
    r = subprocess.run([sys.executable, "-m", "ascend_quant.cli.serve", str(fixture_dir(FOLDER)),
                        "--no-such-vllm-option"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.rstrip().splitlines()[-1] == "Error: vLLM exited with status 2"


@pytest.mark.parametrize("env,message", [
    ({"ASCEND_QUANT_CPU_GEMM": "fast"}, "Error: ASCEND_QUANT_CPU_GEMM='fast': use one of amx, onednn, gemv, f32, int_mm"),
    ({"ASCEND_QUANT_CPU_ISA": "sse"}, "Error: ASCEND_QUANT_CPU_ISA='sse': use one of amx, avx512bf16, avx512, avx2, off"),
    ({"ASCEND_QUANT_CPU_W4A8_GROUPED": "int2"}, "Error: ASCEND_QUANT_CPU_W4A8_GROUPED='int2': expected int8 or int4"),
    ({"ASCEND_QUANT_CPU_GEMM": "amx", "ASCEND_QUANT_CPU_ISA": "avx2"},
     "Error: ASCEND_QUANT_CPU_GEMM=amx needs a CPU with AMX-INT8, the amx GEMV build (ASCEND_QUANT_CPU_ISA unset or "
     "amx) and the C++ operator (ASCEND_QUANT_CPU_OP not 0)")])
@pytest.mark.parametrize("command", ["serve", "eval"])
def test_a_bad_cpu_switch_is_one_line_before_vllm_starts(command, env, message):
    """A wrong CPU-backend switch is refused up front in one line, exit 1, no traceback (vLLM's
    worker would otherwise die on it deep inside its engine start)."""
    folder = fixture_dir(FOLDER)
    args = ([str(folder)] if command == "serve" else
            ["--model", str(fixture_dir("tiny-qwen2-fp32")), "--quantized", str(folder), "--tokens", "64",
             "--seq-len", "32", "--vllm", "--no-save"])
    r = subprocess.run([sys.executable, "-m", "ascend_quant.cli.main", command, *args], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "it/s]" not in line]     # no progress bars counted
    assert lines == [message] and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- one real server

@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`ascend-quant serve FOLDER --port P --api-key KEY` (no --host, no --served-model-name),
    up once it has printed its URL."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_API_KEY"):
        env.pop(var, None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ascend_quant.cli.main", "serve", str(fixture_dir(FOLDER)),
                                 "--port", str(port), "--api-key", KEY, "--dtype", "float32",
                                 "--max-model-len", "256", "--max-num-seqs", "4"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    s = Server(proc, port, log)
    deadline = time.time() + START_S
    try:
        while "is up at" not in s.text():
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{s.text()[-4000:]}"
            assert time.time() < deadline, f"serve not up in {START_S} s:\n{s.text()[-4000:]}"
            time.sleep(1)
        yield s
    finally:
        _stop(proc)


def test_server_listens_on_loopback_only(server):
    import psutil

    sockets = [c for p in psutil.Process(server.proc.pid).children(recursive=True)
               for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
    assert sockets and {c.laddr.ip for c in sockets} == {"127.0.0.1"}, sockets


def test_requests_without_the_key_are_refused(server):
    assert _request(server.base + "/v1/models", key=None)[0] == 401
    assert _request(server.base + "/v1/models", key="sk-wrong")[0] == 401
    assert _request(server.base + "/v1/models")[0] == 200


def test_served_model_is_named_after_the_folder(server):
    _, models = _request(server.base + "/v1/models")
    assert [m["id"] for m in models["data"]] == [FOLDER]


def test_chat_and_completions_are_answered(server):
    status, out = _request(server.base + "/v1/completions",
                           {"model": FOLDER, "prompt": "Legal Entity", "max_tokens": 5, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 5
    status, chat = _request(server.base + "/v1/chat/completions",
                            {"model": FOLDER, "max_tokens": 5, "temperature": 0,
                             "messages": [{"role": "user", "content": "control means"}]})
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] > 0


def test_url_and_example_printed_without_the_key(server):
    text = server.text()
    assert f"is up at {server.base}/v1 (pid {server.proc.pid}" in text
    assert f"curl {server.base}/v1/chat/completions" in text and '"model": "v1_w8a8_dyn"' in text
    assert "$VLLM_API_KEY" in text and KEY not in text


def test_sigterm_to_the_printed_pid_stops_vllm_and_exits_0(server):
    """Last: the supervisor forwards SIGTERM, vLLM shuts down cleanly, nothing is left behind."""
    import psutil

    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0, server.text()[-3000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, alive


# ----------------------------------------------------------------------------- eval --vllm

def _vllm_env() -> dict[str, str]:
    """The environment a user has: the multiprocess engine (vLLM's default; the in-process one
    that other test modules select has no output thread to race), a small KV cache."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def test_eval_json_vllm_is_one_json_document_and_exits_0(tmp_path, reference_model):
    """The issue's case: `eval --json --vllm --tokens 4096` on the reference model. Before the
    fix, vLLM's log lines came first on stdout, and the process sometimes aborted after the
    result (exit 134: 2 of ~45 runs of the vLLM part here; see evaluation/vllm_engine.py)."""
    out = tmp_path / "w8a8-dynamic"
    cli = [sys.executable, "-m", "ascend_quant.cli.main"]
    subprocess.run([*cli, "calibrate", str(reference_model), "-o", str(out), "--scheme", "w8a8-dynamic",
                    "--num-samples", "4", "--seq-len", "128"], check=True, capture_output=True, timeout=300)
    r = subprocess.run([*cli, "eval", "--model", str(reference_model), "--quantized", str(out), "--json", "--vllm",
                        "--tokens", "4096"], capture_output=True, text=True, env=_vllm_env(), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)               # the whole of stdout, nothing before or after
    assert result["tokens"] == 4096 and abs(result["vllm_vs_simulation"]) < 0.01, result
    assert "INFO" in r.stderr                   # vLLM did log, to stderr


_SLOW_OUTPUT_THREAD = """
import json, sys, threading, time
import zmq

close = zmq.Socket.close


def slow_close(self, linger=None):
    # a busy machine: vLLM's output thread leaves late, after the engine was shut down
    if threading.current_thread().name == "EngineCoreOutputQueueThread":
        time.sleep(1.0)
    return close(self, linger)


zmq.Socket.close = slow_close

if __name__ == "__main__":
    from transformers import AutoTokenizer
    from ascend_quant.calibration.data import eval_windows, load_texts
    from ascend_quant.evaluation.vllm_perplexity import vllm_perplexity

    model, texts = sys.argv[1], sys.argv[2]
    windows = eval_windows(load_texts(texts, "eval"), AutoTokenizer.from_pretrained(model), 256, 64)
    ppl = vllm_perplexity(model, windows, quantization="ascend", dtype="float32")
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(json.dumps({"ppl": ppl, "threads": left}))
"""


def test_no_vllm_thread_outlives_vllm_perplexity(tmp_path):
    """What made the exit abort, made certain: vLLM's output thread still ran (and would free
    its last decoded tensors) after `vllm_perplexity` had returned, so the interpreter could
    finalize under it. Now the engine is shut down and the thread joined before the return."""
    from conftest import FIXTURES

    script = tmp_path / "slow_thread.py"
    script.write_text(_SLOW_OUTPUT_THREAD)
    r = subprocess.run([sys.executable, str(script), str(fixture_dir(FOLDER)), str(FIXTURES / "calib.jsonl")],
                       capture_output=True, text=True, env=_vllm_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)               # and vLLM's log lines went to stderr
    assert "EngineCoreOutputQueueThread" not in result["threads"], result
