"""Perplexity through vLLM: the same windows and formula as `evaluation.perplexity`, scored
with vLLM's prompt log-probs, for any checkpoint vLLM serves (float, W8A8, C8 KV cache, ...).

    from ascend_quant.evaluation.vllm_perplexity import vllm_perplexity, eval_windows_for
    windows = eval_windows_for(model_dir, tokens=4096)
    ppl = vllm_perplexity(model_dir, windows, quantization="ascend", dtype="float32")

Every window is one prompt scored independently (its first token has no context and is not
scored): `exp(sum of -log p(token | prefix) / scored tokens)`, as `perplexity()` computes from
the logits. `llm=` reuses an engine; otherwise one is built with `**llm_kwargs` and shut
down before returning (`vllm_engine.shutdown`: nothing of it may outlive the call). vLLM's
log lines go to stderr meanwhile.
"""

from __future__ import annotations

import math
import os

import torch

from ascend_quant.evaluation.vllm_engine import release, shutdown, stdout_to_stderr


def eval_windows_for(model_dir, tokens: int = 4096, seq_len: int = 512) -> torch.Tensor:
    """The evaluation windows `ascend-quant eval` scores, tokenized with the model's tokenizer."""
    from transformers import AutoTokenizer

    from ascend_quant.assets import wiki_paragraphs
    from ascend_quant.calibration.data import eval_windows

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return eval_windows(wiki_paragraphs("eval"), tok, tokens, seq_len)


def prompt_nll(llm, windows: torch.Tensor) -> tuple[float, int]:
    """(sum of next-token NLL, scored tokens) over the windows, from vLLM prompt log-probs."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": w.tolist()} for w in windows]
    outs = llm.generate(prompts, params, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows.tolist(), outs):
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(window):
            raise RuntimeError("vLLM returned no prompt log-probs for a window")
        for tok, lp in zip(window[1:], plp[1:]):
            total -= lp[tok].logprob
            count += 1
    return total, count


def _engine(model_dir, max_model_len: int, **llm_kwargs):
    from vllm import LLM

    kwargs = dict(max_model_len=max_model_len, enforce_eager=True, seed=0, enable_prefix_caching=False)
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        # a fixed KV budget: vLLM's CPU default reserves 92% of RAM and refuses to start
        # when other processes hold more than 8% of it
        kwargs["kv_cache_memory_bytes"] = 1 << 30
    kwargs.update(llm_kwargs)
    return LLM(str(model_dir), **kwargs)


def vllm_perplexity(model_dir=None, windows: torch.Tensor | None = None, *, llm=None, tokens: int = 4096,
                    seq_len: int = 512, **llm_kwargs) -> float:
    """Perplexity of the windows (default: `eval_windows_for(model_dir, tokens, seq_len)`)."""
    if windows is None:
        windows = eval_windows_for(model_dir, tokens, seq_len)
    own = llm is None
    with stdout_to_stderr():            # vLLM's log lines stay off a caller's machine-readable stdout
        if own:
            llm = _engine(model_dir, max(seq_len, int(windows.shape[1])) + 8, **llm_kwargs)
        try:
            total, count = prompt_nll(llm, windows)
        finally:
            if own:
                shutdown(llm)
                del llm
                release()
    value = math.exp(total / count)
    if not math.isfinite(value):
        raise FloatingPointError("perplexity through vLLM is not finite")
    return value
