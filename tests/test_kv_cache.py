"""C8 (int8 KV cache): the paged kernels against their plain reference, the NPU wiring through
the op emulation, and the attention method inside real vLLM (greedy equality with the exact
reference under chunked prefill and prefix caching, the KV cache doubling, fewer preemptions,
msModelSlim's C8 fixture served with its scales).

Engines are shared at module scope (tiny models, in-process, ~5-15 s each on 2 cores).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch

from ascend_quant.runtime.kernels import npu_emulation
from ascend_quant.runtime.kernels.npu import NpuC8PagedAttention
from ascend_quant import native
from ascend_quant.runtime.paged import c8

# ----------------------------------------------------------------------------- op level


def _scenario(h=9, hkv=3, d=64, bs=32, ctx=(70, 33, 5, 129), qlen=(20, 1, 5, 1), seed=0, dtype=torch.float32):
    """Random pages for several requests (chunked prefill, decode, full prefill, a decode that
    starts a new block), scattered over shuffled physical blocks, written through slot_mapping
    with padding slots (-1)."""
    g = torch.Generator().manual_seed(seed)
    r = len(ctx)
    maxb = max((c + bs - 1) // bs for c in ctx) + 1
    nb = sum((c + bs - 1) // bs for c in ctx) + 3
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(r, maxb, dtype=torch.int32)
    slots, used = [], 0
    for i, c in enumerate(ctx):
        n = (c + bs - 1) // bs
        bt[i, :n] = perm[used:used + n].int()
        used += n
        slots += [int(bt[i, p // bs]) * bs + p % bs for p in range(c)]
    slots = torch.tensor(slots[:5] + [-1] + slots[5:] + [-1, -1])
    key = torch.randn(len(slots), hkv, d, generator=g) * 2
    value = torch.randn(len(slots), hkv, d, generator=g)
    ks = torch.rand(hkv * d, generator=g) * 0.02 + 0.005          # some clipping at |k| > ~0.6-3
    vs = torch.rand(hkv * d, generator=g) * 0.02 + 0.01
    qsl = torch.tensor([0] + torch.tensor(qlen).cumsum(0).tolist(), dtype=torch.int32)
    q = (torch.randn(int(qsl[-1]), h, d, generator=g)).to(dtype)
    return dict(key=key.to(dtype), value=value.to(dtype), slots=slots, ks=ks, vs=vs, qsl=qsl, q=q,
                sl=torch.tensor(ctx, dtype=torch.int32), bt=bt, nb=nb, h=h, hkv=hkv, d=d, bs=bs)


def _written(s, impl="reference"):
    cache = torch.zeros(s["nb"], s["hkv"], s["bs"], 2 * s["d"], dtype=torch.int8)
    fn = c8.write_reference if impl == "reference" else c8.write_native
    fn(cache, s["key"], s["value"], s["slots"], s["ks"], s["vs"])
    return cache


def test_native_kernel_builds():
    """The C kernel is part of what the suite tests: without a compiler it fails, never skips."""
    assert native.load() is not None, f"the C paged-attention kernel did not build: {native.error()}"


def test_reference_write_stores_quantized_values_at_their_slots():
    s = _scenario()
    cache = _written(s)
    kc, vc = c8.page_views(cache)
    keep = s["slots"] >= 0
    slots = s["slots"][keep]
    kq = c8.quantize_kv(s["key"][keep], s["ks"])
    vq = c8.quantize_kv(s["value"][keep], s["vs"])
    assert kq.abs().max() == 128 or kq.max() == 127          # the scenario clips some keys
    b, o = slots // s["bs"], slots % s["bs"]
    assert torch.equal(kc[b, :, :, o], kq) and torch.equal(vc[b, :, o, :], vq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_equals_reference(dtype):
    s = _scenario(dtype=dtype)
    assert torch.equal(_written(s, "native"), _written(s, "reference"))


def test_reference_attention_is_plain_attention_over_fake_quantized_kv():
    """The oracle itself: per request, sdpa over round-tripped K/V in token order."""
    s = _scenario()
    cache = _written(s)
    out = c8.attention_reference(s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    # token order of the writes = request order; rebuild each request's K/V from the inputs
    keep = s["slots"] >= 0
    k_all = c8.quantize_kv(s["key"][keep], s["ks"]).float() * s["ks"].view(1, s["hkv"], s["d"])
    v_all = c8.quantize_kv(s["value"][keep], s["vs"]).float() * s["vs"].view(1, s["hkv"], s["d"])
    start = 0
    for r, ctx in enumerate(s["sl"].tolist()):
        k, v = k_all[start:start + ctx], v_all[start:start + ctx]
        start += ctx
        q = s["q"][s["qsl"][r]:s["qsl"][r + 1]]
        qlen = q.shape[0]
        mask = torch.arange(ctx).view(1, ctx) <= torch.arange(ctx - qlen, ctx).view(qlen, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out[s["qsl"][r]:s["qsl"][r + 1]], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


IMPLS = ["torch", "native"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [dict(h=9, hkv=3, d=64, bs=32), dict(h=4, hkv=2, d=32, bs=128),
                                   dict(h=8, hkv=8, d=64, bs=64)])
@pytest.mark.parametrize("causal", [True, False])
def test_fast_attention_matches_reference(impl, shape, causal):
    s = _scenario(**shape)
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    ref = c8.attention_reference(*args, causal=causal)
    out = c8.attention(*args, causal=causal, impl=impl)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_fast_attention_long_prefill_and_many_decodes(impl):
    """A 300-token chunk continuing a 200-token prefix cache hit, next to 12 decodes; bf16 queries."""
    ctx = (500,) + tuple(40 + 17 * i for i in range(12))
    s = _scenario(ctx=ctx, qlen=(300,) + (1,) * 12, dtype=torch.bfloat16, bs=128)
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    torch.testing.assert_close(c8.attention(*args, impl=impl), c8.attention_reference(*args), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ["avx2", None])
def test_native_attention_builds_match_reference_on_decode_and_prefill_rows(isa, monkeypatch):
    """The kernel's two inner paths (a few query rows on the int8 page: decode; whole blocks
    converted once: prefill), on the -march=native build and on the AVX2 build that
    `ASCEND_QUANT_CPU_ISA=avx2` selects: GQA groups of 1 to 7 rows, head dims with and without a
    vector tail, a soft-cap and a window."""
    monkeypatch.setenv("ASCEND_QUANT_CPU_ISA", isa or "")
    lib = native.load()
    assert lib is not None, native.error()
    assert (lib is native.C8_AVX2.load()) == (isa == "avx2")
    for h, hkv, d in [(9, 3, 64), (7, 1, 40), (4, 4, 32)]:
        ctx = (300,) + tuple(40 + 37 * i for i in range(6))
        s = _scenario(h=h, hkv=hkv, d=d, ctx=ctx, qlen=(120,) + (1,) * 6, dtype=torch.bfloat16, bs=32)
        cache = _written(s)
        args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
        for opts in ({}, dict(sliding_window=50, softcap=30.0)):
            torch.testing.assert_close(c8.attention_native(*args, lib=lib, **opts), c8.attention_reference(*args, **opts),
                                       atol=2e-5, rtol=1e-4)


def test_native_attention_writes_bf16_output_rows_in_place():
    """vLLM's output buffer: [T, H*D] in the model dtype, filled by the kernel with the scales applied."""
    s = _scenario(dtype=torch.bfloat16)
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    out = torch.full((s["q"].shape[0] + 3, s["h"] * s["d"]), 7.0, dtype=torch.bfloat16)
    c8.attention(*args, impl="native", out=out[: s["q"].shape[0]])
    ref = c8.attention_reference(*args).reshape(s["q"].shape[0], -1)
    torch.testing.assert_close(out[: s["q"].shape[0]].float(), ref, atol=1e-2, rtol=1e-2)
    assert bool((out[s["q"].shape[0]:] == 7).all())                  # padding rows untouched


# ----------------------------------------------------------------------------- sliding window, soft-cap

# the scenario's contexts are (70, 33, 5, 129): windows below, equal to and above each of them
WINDOWS = [1, 16, 33, 70, 129, 500]


def _window_mask(ctx: int, qlen: int, window: int) -> torch.Tensor:
    """[qlen, ctx] built element by element: query i sits at p = ctx - qlen + i and sees key j
    iff p - window < j <= p (HF's and vLLM's sliding window)."""
    mask = torch.zeros(qlen, ctx, dtype=torch.bool)
    for i in range(qlen):
        p = ctx - qlen + i
        for j in range(ctx):
            mask[i, j] = p - window < j <= p
    return mask


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_sliding_window_is_plain_attention_with_an_explicit_window_mask(window, softcap):
    """The oracle with a window (and Gemma-2's soft-cap): per request, plain attention over the
    round-tripped K/V with the window mask built independently."""
    s = _scenario()
    cache = _written(s)
    out = c8.attention_reference(s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125,
                                 sliding_window=window, softcap=softcap)
    keep = s["slots"] >= 0
    k_all = c8.quantize_kv(s["key"][keep], s["ks"]).float() * s["ks"].view(1, s["hkv"], s["d"])
    v_all = c8.quantize_kv(s["value"][keep], s["vs"]).float() * s["vs"].view(1, s["hkv"], s["d"])
    g = s["h"] // s["hkv"]
    start = 0
    for r, ctx in enumerate(s["sl"].tolist()):
        k, v = k_all[start:start + ctx], v_all[start:start + ctx]
        start += ctx
        q = s["q"][s["qsl"][r]:s["qsl"][r + 1]]
        mask = _window_mask(ctx, q.shape[0], window)
        if softcap is None:
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.125,
                enable_gqa=True)
        else:
            kk, vv = k.transpose(0, 1).repeat_interleave(g, 0), v.transpose(0, 1).repeat_interleave(g, 0)
            logits = q.transpose(0, 1) @ kk.transpose(1, 2) * 0.125
            logits = softcap * torch.tanh(logits / softcap)
            ref = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ vv
        torch.testing.assert_close(out[s["qsl"][r]:s["qsl"][r + 1]], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_sliding_window_and_softcap_change_the_result():
    """Guards the tests above against vacuous settings: both options move the output."""
    s = _scenario()
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    plain = c8.attention_reference(*args)
    assert not torch.allclose(c8.attention_reference(*args, sliding_window=16), plain, atol=1e-3)
    assert not torch.allclose(c8.attention_reference(*args, softcap=2.0), plain, atol=1e-3)
    assert torch.equal(c8.attention_reference(*args, sliding_window=-1), plain)        # vLLM's "no window"
    assert torch.equal(c8.attention_reference(*args, sliding_window=500), plain)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [dict(h=9, hkv=3, d=64, bs=32), dict(h=4, hkv=2, d=32, bs=128),
                                   dict(h=8, hkv=8, d=64, bs=16)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_fast_attention_with_sliding_window_matches_reference(impl, shape, window, softcap):
    """Chunked prefill, decodes, a full prefill and a decode opening a block, GQA and MHA."""
    s = _scenario(**shape)
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    opts = dict(sliding_window=window, softcap=softcap)
    torch.testing.assert_close(c8.attention(*args, impl=impl, **opts), c8.attention_reference(*args, **opts),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [64, 200, 4096])
def test_fast_attention_sliding_window_long_prefill_and_many_decodes(impl, window):
    """A 300-token chunk after a 200-token prefix next to 12 decodes, bf16 queries, Gemma-2's cap 50."""
    ctx = (500,) + tuple(40 + 17 * i for i in range(12))
    s = _scenario(ctx=ctx, qlen=(300,) + (1,) * 12, dtype=torch.bfloat16, bs=32)
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    for cap in (None, 50.0):
        opts = dict(sliding_window=window, softcap=cap)
        torch.testing.assert_close(c8.attention(*args, impl=impl, **opts), c8.attention_reference(*args, **opts),
                                   atol=2e-5, rtol=1e-4)


def test_native_sliding_window_never_reads_blocks_outside_the_window(tmp_path):
    """vLLM's sliding-window manager frees blocks no query can see (their table entries become
    its null block). Here those entries point far outside the cache: the kernel would crash on
    reading one, so it runs in a subprocess; the result must equal the reference on the real table."""
    import subprocess
    import sys

    s = _scenario(ctx=(300, 200, 97), qlen=(40, 1, 97), bs=16)
    window = 50
    cache = _written(s)
    bt = s["bt"].clone()
    for r, (ctx, q0, q1) in enumerate(zip(s["sl"].tolist(), s["qsl"][:-1].tolist(), s["qsl"][1:].tolist())):
        first_seen = max(0, ctx - (q1 - q0) - window + 1)
        bt[r, : first_seen // 16] = 1 << 28
    assert int((bt == 1 << 28).sum()) > 10
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"])
    torch.save({"args": args, "bt": bt, "ref": c8.attention_reference(*args, s["bt"], 0.125, sliding_window=window)},
               tmp_path / "case.pt")
    code = ("import sys, torch; from ascend_quant.runtime.paged import c8\n"
            f"c = torch.load({str(tmp_path / 'case.pt')!r})\n"
            f"out = c8.attention_native(*c['args'], c['bt'], 0.125, sliding_window={window})\n"
            "torch.testing.assert_close(out, c['ref'], atol=2e-5, rtol=1e-4); print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_sliding_window_without_causal_mask_is_refused(impl):
    s = _scenario()
    cache = _written(s)
    args = (s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    with pytest.raises(NotImplementedError, match="causal"):
        c8.attention(*args, impl=impl, causal=False, sliding_window=8)
    with pytest.raises(ValueError, match="int"):
        c8.attention(*args, impl=impl, sliding_window=(8, 0))


# ----------------------------------------------------------------------------- NPU wiring (emulated)


@pytest.mark.parametrize("decode_only", [True, False])
def test_npu_path_through_emulation_matches_reference(decode_only):
    ctx, qlen = ((40, 75, 129), (1, 1, 1)) if decode_only else ((70, 33, 5, 129), (20, 1, 5, 1))
    s = _scenario(h=4, hkv=2, d=32, bs=32, ctx=ctx, qlen=qlen)
    with npu_emulation.installed():
        npu = NpuC8PagedAttention(s["h"], s["hkv"], s["d"], 0.125, s["ks"], s["vs"], s["bs"], dtype=torch.float32)
        kcache, vcache = npu.new_cache(s["nb"])
        npu.write(kcache, vcache, s["key"], s["value"], s["slots"])
        out = npu.forward(s["q"], kcache, vcache, s["qsl"], s["sl"], s["bt"])
    cache = _written(s)
    kc, vc = c8.page_views(cache)                                     # same int8 values, other layout
    assert torch.equal(kcache, kc.permute(0, 3, 1, 2)) and torch.equal(vcache, vc.permute(0, 2, 1, 3))
    ref = c8.attention_reference(s["q"], cache, s["ks"], s["vs"], s["qsl"], s["sl"], s["bt"], 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_npu_path_rejects_block_sizes_the_npu_cannot_take():
    with pytest.raises(ValueError, match="multiples of 32|divisible by 32"):
        NpuC8PagedAttention(4, 2, 32, 0.1, torch.ones(64), torch.ones(64), block_size=16)


# ----------------------------------------------------------------------------- inside vLLM

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

KV_BYTES = 256 * 1024          # tiny model: bf16 pages -> 16 blocks of 32 tokens, int8 -> 32
BLOCK = 32
PROMPTS = [list(range(1, 70)), list(range(1, 40)) + [5, 77, 140, 3, 99, 250, 31, 8],
           [300, 301, 40, 41, 42, 7, 7, 7, 12, 400, 17], list(range(1, 70))]
GEN = 32


def _c8_tiny_checkpoint(src: Path, out: Path) -> Path:
    """The sharpened fp32 tiny model, float weights, with per-channel absmax C8 scales of its
    post-RoPE K/V on the calibration texts (written with formats.ascend)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_quant.formats.ascend import write_checkpoint
    from ascend_quant.arch.attention import kv_channels, wrap_attention
    from runtime_helpers import calibration_texts

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(src))
    absmax: dict[tuple[int, str], torch.Tensor] = {}

    def hook(module, key, value):
        for name, t in (("k", key), ("v", value)):
            m = kv_channels(t).abs().amax(0)
            k = (module.layer_idx, name)
            absmax[k] = m if k not in absmax else torch.maximum(absmax[k], m)

    with torch.no_grad(), wrap_attention(model, hook):
        for text in calibration_texts(4):
            model(**tok(text, return_tensors="pt"), use_cache=False)
    state = load_file(src / "model.safetensors")
    tensors = dict(state)
    desc = {k: "FLOAT" for k in state}
    for (layer, name), m in absmax.items():
        p = f"model.layers.{layer}.self_attn.{name}_proj"
        tensors[f"{p}.kv_cache_scale"] = (m.clamp_min(1e-6) / 127).float()
        tensors[f"{p}.kv_cache_offset"] = torch.zeros_like(m)
        desc[f"{p}.kv_cache_scale"] = desc[f"{p}.kv_cache_offset"] = "C8"
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "ascend"}
    return write_checkpoint(out, tensors, desc, source_dir=src, config=config)


def _float_copy(c8_dir: Path, out: Path) -> Path:
    from ascend_quant.formats.ascend import read_checkpoint, write_checkpoint

    ck = read_checkpoint(c8_dir)
    tensors = {k: v for k, v in ck.tensors().items() if "kv_cache" not in k}
    desc = {k: "FLOAT" for k in tensors}
    return write_checkpoint(out, tensors, desc, source_dir=c8_dir, config=json.loads((c8_dir / "config.json").read_text()))


def _free(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _llm(path, **kwargs):
    """vllm.LLM with the KV budget in bytes (VLLM_CPU_KVCACHE_SPACE, whole GiB, would override it)."""
    from vllm import LLM

    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return LLM(str(path), quantization="ascend", enforce_eager=True, max_model_len=256, seed=0, max_num_seqs=4,
                   kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK, disable_log_stats=False, **kwargs)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def _engine_facts(llm) -> dict:
    def probe(model):
        from vllm.model_executor.layers.attention import Attention

        layers = [m for m in model.modules() if isinstance(m, Attention)]
        return {"impl": sorted({type(m.impl).__name__ for m in layers}),
                "kv_dtype": sorted({str(m.kv_cache_torch_dtype) for m in layers}),
                "cache_dtype": sorted({str(m.kv_cache.dtype) if isinstance(m.kv_cache, torch.Tensor) else
                                       str(m.kv_cache[0].dtype) for m in layers})}
    facts = llm.apply_model(probe)[0]
    facts["num_blocks"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    return facts


def _preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _long_workload(llm) -> int:
    """4 sequences of 100 + 100 tokens (4 x 7 blocks of 32 wanted at once; bf16 holds 16): preemptions."""
    from vllm import SamplingParams

    before = _preemptions(llm)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(100)] for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 100 for o in outs)
    return _preemptions(llm) - before


@pytest.fixture(scope="module")
def tiny_c8(tmp_path_factory):
    from runtime_helpers import sharpened_tiny_model

    d = tmp_path_factory.mktemp("kv")
    return _c8_tiny_checkpoint(sharpened_tiny_model(d / "tiny-sharp"), d / "tiny-c8")


@pytest.fixture(scope="module")
def c8_engine_results(tiny_c8):
    """fp32 C8 engine, chunked prefill of 16-token chunks, prefix caching; prompts run twice."""
    from vllm import SamplingParams

    llm = _llm(tiny_c8, dtype="float32", max_num_batched_tokens=16, enable_chunked_prefill=True,
               enable_prefix_caching=True, model_loader_extra_config={"enable_weights_track": True})
    try:
        sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        res = {"first": [list(o.outputs[0].token_ids) for o in first],
               "second": [list(o.outputs[0].token_ids) for o in second],
               "cached": [o.num_cached_tokens or 0 for o in second],
               "facts": _engine_facts(llm),
               "preemptions": _long_workload(llm)}
    finally:
        _free(llm)
    return res


@pytest.fixture(scope="module")
def bf16_engine_results(tiny_c8, tmp_path_factory):
    """The same model without C8 scales, bf16 KV cache of the same byte budget."""
    folder = _float_copy(tiny_c8, tmp_path_factory.mktemp("kvf") / "tiny-float")
    llm = _llm(folder, dtype="bfloat16")
    try:
        res = {"facts": _engine_facts(llm), "preemptions": _long_workload(llm)}
    finally:
        _free(llm)
    return res


def _reference_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from ascend_quant.runtime.reference_model import load_reference_model

    model = load_reference_model(path, torch.float32, kv_cache=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.vllm
def test_vllm_c8_greedy_equals_exact_reference_with_chunked_prefill_and_prefix_hits(tiny_c8, c8_engine_results):
    res = c8_engine_results
    assert res["facts"]["impl"] == ["AscendC8AttentionImpl"]
    assert res["facts"]["kv_dtype"] == ["torch.int8"] and res["facts"]["cache_dtype"] == ["torch.int8"]
    assert res["second"] == res["first"]
    # the second pass hit the prefix cache on every prompt with a full block (prompt 2 has none)
    assert all(c >= BLOCK for c, p in zip(res["cached"], PROMPTS) if len(p) >= BLOCK), res["cached"]
    for prompt, tokens in zip(PROMPTS[:3], res["first"]):
        assert tokens == _reference_greedy(tiny_c8, prompt, GEN)


@pytest.mark.vllm
def test_vllm_c8_doubles_kv_cache_and_preempts_less(c8_engine_results, bf16_engine_results):
    c8_blocks = c8_engine_results["facts"]["num_blocks"]
    bf16_blocks = bf16_engine_results["facts"]["num_blocks"]
    assert bf16_engine_results["facts"]["impl"] == ["CPUAttentionBackendImpl"]
    assert c8_blocks >= 1.9 * bf16_blocks, (c8_blocks, bf16_blocks)
    assert bf16_engine_results["preemptions"] > 0
    assert c8_engine_results["preemptions"] < bf16_engine_results["preemptions"]


@pytest.mark.vllm
def test_msmodelslim_c8_fixture_serves_with_its_scales(caplog):
    from vllm import LLM, SamplingParams

    from ascend_quant.runtime.reference_model import load_reference_model
    from conftest import fixture_dir

    path = fixture_dir("v1_w8a8_static_c8")
    llm = LLM(str(path), quantization="ascend", enforce_eager=True, dtype="float32", max_model_len=128, seed=0,
              model_loader_extra_config={"enable_weights_track": True})
    try:
        facts = _engine_facts(llm)
        prompt = [5, 77, 140, 3, 99, 250, 31, 8]
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0, logprobs=1,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    finally:
        _free(llm)
    assert facts["impl"] == ["AscendC8AttentionImpl"] and facts["cache_dtype"] == ["torch.int8"]
    tokens = list(out.outputs[0].token_ids)
    lps = torch.tensor([lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)])
    ids = torch.tensor([prompt + tokens[:-1]])
    errs = {}
    for kv in (True, False):
        with torch.no_grad():
            ref = torch.log_softmax(load_reference_model(path, torch.float32, kv_cache=kv)(ids).logits[0, len(prompt) - 1:], -1)
        errs[kv] = (ref[torch.arange(len(tokens)), torch.tensor(tokens)] - lps).abs().max().item()
    assert errs[True] < 2e-3 < errs[False], errs          # the scales are applied, exactly as the reference does


# ----------------------------------------------------------------------------- inside vLLM: sliding window

SW_WINDOW = 24          # below every prompt + generation (48-101 tokens), not a multiple of the block size


@pytest.fixture(scope="module")
def tiny_c8_sliding(tmp_path_factory):
    """The sharpened tiny Qwen2 with every layer a sliding-window layer (W = 24), C8 scales
    calibrated on it. vLLM's Qwen2 takes the window from the config (use_sliding_window);
    transformers applies it through its sliding-window causal mask."""
    from runtime_helpers import sharpened_tiny_model

    d = tmp_path_factory.mktemp("kvsw")
    src = sharpened_tiny_model(d / "tiny-sharp-sw")
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    config.update(use_sliding_window=True, sliding_window=SW_WINDOW, max_window_layers=0,
                  layer_types=["sliding_attention"] * n)
    (src / "config.json").write_text(json.dumps(config, indent=2))
    return _c8_tiny_checkpoint(src, d / "tiny-c8-sw")


@pytest.mark.vllm
def test_vllm_c8_sliding_window_greedy_equals_exact_reference(tiny_c8_sliding, tiny_c8):
    """Chunked prefill (16-token chunks) and prefix caching over sliding-window layers: vLLM's
    sliding-window manager frees the blocks behind the window; tokens equal the reference model's
    (C8 fake-quant, HF's window mask), which differ from the full-attention model's."""
    from vllm import SamplingParams

    llm = _llm(tiny_c8_sliding, dtype="float32", max_num_batched_tokens=16, enable_chunked_prefill=True,
               enable_prefix_caching=True)
    try:
        windows = llm.apply_model(lambda model: sorted({
            m.impl.sliding_window for m in model.modules() if type(m).__name__ == "Attention"}))[0]
        facts = _engine_facts(llm)
        sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
        first = [list(o.outputs[0].token_ids) for o in
                 llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
        second = [list(o.outputs[0].token_ids) for o in
                  llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    finally:
        _free(llm)
    assert windows == [SW_WINDOW]
    assert facts["impl"] == ["AscendC8AttentionImpl"] and facts["cache_dtype"] == ["torch.int8"]
    assert second == first
    refs = [_reference_greedy(tiny_c8_sliding, p, GEN) for p in PROMPTS[:3]]
    assert first[:3] == refs
    assert any(r != _reference_greedy(tiny_c8, p, GEN) for r, p in zip(refs, PROMPTS[:3]))
