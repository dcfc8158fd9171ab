"""`ascend-quant eval`: perplexity of the float model and of a quantized checkpoint."""

from __future__ import annotations

import json

import click


@click.command("eval")
@click.option("--model", "float_model", default=None, help="The float model (default: the embedded reference).")
@click.option("--quantized", type=click.Path(), required=True, help="An Ascend checkpoint folder.")
@click.option("--dataset", default=None, help="Evaluation text (default: the held-out split of the built-in wiki).")
@click.option("--tokens", type=int, default=16384, show_default=True, help="Tokens to score.")
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--threads", type=int, default=None)
@click.option("--vllm", "with_vllm", is_flag=True,
              help="Also score the quantized checkpoint through vLLM (our `ascend` method, fp32) on the same windows.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--save/--no-save", default=True, show_default=True,
              help="Also write the result as eval_results.json into the checkpoint folder.")
def eval_cmd(float_model, quantized, dataset, tokens, seq_len, threads, with_vllm, as_json, save):
    """Perplexity float vs quantized (exact reference arithmetic, no vLLM), and per-layer error."""
    import torch

    from ascend_quant.assets import AssetError, reference_model_dir
    from ascend_quant.calibration.data import DataError
    from ascend_quant.evaluation.report import EvalError, evaluate, format_result

    if threads:
        torch.set_num_threads(threads)
    if with_vllm:
        from ascend_quant.runtime.kernels.cpu import check_env

        try:
            check_env()
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    try:
        result = evaluate(float_model or str(reference_model_dir()), quantized, dataset, tokens, seq_len,
                          with_vllm)
    except (EvalError, DataError, AssetError, FloatingPointError) as e:
        raise click.ClickException(str(e)) from None
    if save:
        result.save(quantized)
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else format_result(result))
