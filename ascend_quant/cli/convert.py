"""`ascend-quant convert SRC -o OUT`: between msModelSlim's layouts, the v1 layout and compressed-tensors."""

from __future__ import annotations

import click


@click.command("convert")
@click.argument("src", type=click.Path(file_okay=False))
@click.option("-o", "--output", "out", type=click.Path(), required=True, help="Folder to write (must not exist).")
@click.option("--to", "to", type=click.Choice(["ascend-v1", "compressed-tensors"]), default="ascend-v1",
              show_default=True, help="Target layout.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Serving dtype: re-encodes static W8A8 deq_scale (bf16: float32, fp16/fp32: int64) and sets "
                   "config.json's dtype.")
@click.option("--config-from", "config_from", type=click.Path(file_okay=False), default=None,
              help="Model folder whose config.json and tokenizer go beside the output (msModelSlim v0 outputs "
                   "have none).")
@click.option("--drop-kv-cache", is_flag=True,
              help="Convert the weights and leave out KV-cache scales that have no equivalent in the target.")
def convert_cmd(src: str, out: str, to: str, dtype: str | None, config_from: str | None,
                drop_kv_cache: bool) -> None:
    """Convert checkpoint SRC (msModelSlim v0/v1/MindIE names, or compressed-tensors) into OUT."""
    from ascend_quant.formats.convert import ConversionError, convert

    try:
        result = convert(src, out, to=to, dtype=dtype, config_from=config_from, drop_kv_cache=drop_kv_cache)
    except ConversionError as e:
        raise click.ClickException(" ".join(str(e).split("\n"))) from None
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(f"ok: {result.source_layout} -> {result.target}: {result.out}")


if __name__ == "__main__":
    convert_cmd()
