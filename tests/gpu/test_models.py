"""GPU tier: real transformers model code on the provider (issue "Real model code on the fast
path", item 5). Tiny random-weight models built from configs in code (no downloads, no network).

Two ways in are checked:
* ``attn_implementation="cudnn"`` (``integrations.transformers.register()``): every attention
  layer must be SERVED (one ``dense_fwd`` and one ``dense_bwd`` per layer, zero fallbacks) on a
  right-padded bf16 batch, and loss and every parameter gradient must match eager attention;
* ``attn_implementation="sdpa"`` inside ``csp.enable()``: transformers passes a boolean padding /
  sliding-window mask to F.scaled_dot_product_attention, which the provider serves on its cuDNN
  bias path; the telemetry must show one served call per layer and zero fallbacks (gpt-oss is
  left out: transformers refuses sdpa for it, ``_supports_sdpa = False``).
Also: autocast (fp32 weights), attention dropout, a left-padded batch (falls back, then served on
the bias path inside ``csp.enable()``), and the telemetry of generate()'s decode steps.

Accuracy: the reference is eager attention in float32; a bf16 result passes when its error
(max |err| / max |ref|, per tensor) is within the tolerance table of ``tests.util`` or within
three times the error of eager attention itself run in bf16, whichever is larger (a whole bf16
model is chaotic enough that a fixed bound alone would be flaky). Sharper, per layer: each served
attention output must equal the model's own eager attention in float32 on the same inputs, on
the real (unpadded) query rows, within the bf16 output tolerance. A failure lists every tensor over
its tolerance with the worst element, and the telemetry.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.integrations import transformers as csp_hf
from tests.util import TOL, grad_tol, rel_error

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
NAME = csp_hf.DEFAULT_NAME
S = 96  # sequence length
W = 24  # sliding window (HF semantics: a query sees the last W keys including itself)
HEADS, KV_HEADS = 4, 2  # GQA group of 2
#: Right padding for the cudnn runs: rows 1 and 2 pad more than W - 1 tokens, so some padded query
#: rows of sliding layers see no key at all (the lengths path must keep them finite).
LENGTHS = (S, 70, 37)
#: Right padding for the sdpa runs: less than W - 1 per row, so no query row is fully masked.
LENGTHS_SDPA = (S, 80, 75)
FAMILIES = ("llama", "qwen2", "mistral", "gemma3", "gpt_oss")
COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=HEADS,
              num_key_value_heads=KV_HEADS, head_dim=32, max_position_embeddings=256, attention_dropout=0.0)


@pytest.fixture(scope="module")
def hf():
    import transformers  # the GPU box has transformers 5.x: a missing one is a failure, not a skip

    registration = csp_hf.register()
    yield transformers
    registration.remove()


def _config(hf, family: str):
    if family == "llama":  # GQA, causal
        return hf.LlamaConfig(num_hidden_layers=2, **COMMON)
    if family == "qwen2":  # layer 0 full attention, layers 1-2 sliding window
        return hf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=W, max_window_layers=1,
                              **COMMON)
    if family == "mistral":  # sliding window in every layer
        return hf.MistralConfig(num_hidden_layers=2, sliding_window=W, **COMMON)
    if family == "gemma3":  # alternating sliding / full, q/k norms, query_pre_attn_scalar scaling
        return hf.Gemma3TextConfig(num_hidden_layers=2, sliding_window=W, sliding_window_pattern=2,
                                   query_pre_attn_scalar=32, **COMMON)
    if family == "gpt_oss":  # sinks + alternating sliding / full; both experts active (routing is continuous)
        return hf.GptOssConfig(num_hidden_layers=2, sliding_window=W, num_local_experts=2, num_experts_per_tok=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    raise ValueError(family)


def _build(hf, family: str, impl: str, state: dict, dtype: torch.dtype):
    cfg = copy.deepcopy(_config(hf, family))  # models must not share a config: it holds the implementation
    extra = {"experts_implementation": "eager"} if family == "gpt_oss" else {}
    model = hf.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, **extra)
    model.load_state_dict(state)
    return model.to(device=DEV, dtype=dtype).train()


def _weights(hf, family: str) -> dict:
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if family == "gpt_oss" else {}
    model = hf.AutoModelForCausalLM.from_config(copy.deepcopy(_config(hf, family)), attn_implementation="eager",
                                                **extra)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _batch(lengths, vocab: int = COMMON["vocab_size"]):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (len(lengths), S), generator=gen)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)  # padded positions carry no loss
    return ids.to(DEV), mask.to(DEV), labels.to(DEV)


def _train_step(model, batch, autocast: bool = False):
    ids, mask, labels = batch
    model.zero_grad(set_to_none=True)
    before = counters.stats()
    with torch.autocast("cuda", dtype=BF16, enabled=autocast):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.cuda.synchronize()
    delta = (counters.stats() - before).to_dict()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float().reshape(1), grads, delta


def _served(delta: dict, layers: int) -> list[str]:
    """Problems with the telemetry of one training step: each layer served once forward and backward."""
    problems = []
    for path in ("dense_fwd", "dense_bwd"):
        if delta[path] != {"served": layers, "fallback": {}}:
            problems.append(f"{path}: expected {{'served': {layers}, 'fallback': {{}}}}, got {delta[path]}")
    for path in ("varlen_fwd", "varlen_bwd"):
        if delta[path] != {"served": 0, "fallback": {}}:
            problems.append(f"{path}: expected no calls, got {delta[path]}")
    return problems


def _group(name: str) -> int:
    """GQA: k/v projections get the summed gradient of HEADS / KV_HEADS query heads."""
    return HEADS // KV_HEADS if any(p in name for p in ("k_proj", "v_proj", "k_norm")) else 1


def _accuracy(ref, yard, cand) -> list[str]:
    """Every tensor of ``cand`` over max(table tolerance, 2 x eager-bf16 error), with its worst element."""
    (loss_r, grads_r, _), (loss_y, grads_y, _), (loss_c, grads_c, _) = ref, yard, cand
    problems = []
    if set(grads_c) != set(grads_r):
        problems.append(f"parameters with gradients differ: {sorted(set(grads_c) ^ set(grads_r))}")
    items = [("loss", loss_c, loss_r, loss_y, TOL[BF16])]
    items += [(f"grad {n}", grads_c[n], grads_r[n], grads_y[n], grad_tol(BF16, _group(n)))
              for n in sorted(grads_r) if n in grads_c]
    for name, c, r, y, floor in items:
        if not torch.isfinite(c).all():
            problems.append(f"{name}: non-finite values")
            continue
        err, worst = rel_error(c, r)
        err_y, _ = rel_error(y, r)
        tol = max(floor, 3.0 * err_y)
        if err > tol:
            problems.append(f"{name}: err {err:.3e} > tol {tol:.3e} (eager bf16 err {err_y:.3e}) at {worst}: "
                            f"got {c[worst].item():.6g}, want {r[worst].item():.6g}")
    return problems


def _report(family: str, impl: str, delta: dict, problems: list[str]) -> str:
    return f"{family} attn_implementation={impl!r}:\n  " + "\n  ".join(problems) + f"\n  telemetry: {delta}"


def _eager_on_same_inputs(module, query, key, value, attention_mask, kwargs):
    """The layer's own eager attention in float32 on the inputs the served call got."""
    mask = attention_mask.to_bool() if isinstance(attention_mask, csp_hf.CudnnMask) else attention_mask
    additive = torch.zeros(mask.shape, device=DEV).masked_fill_(~mask, torch.finfo(torch.float32).min)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    options = {k: v for k, v in kwargs.items() if k not in ("dropout", "s_aux")}
    with torch.no_grad():
        out, _ = eager(module, query.detach().float(), key.detach().float(), value.detach().float(), additive,
                       dropout=0.0, **options)
    return out


def _layer_checks(monkeypatch, real_rows: torch.Tensor) -> tuple[list[str], list[int]]:
    """Wrap the integration's attention function: compare each served output with eager.
    Returns (problems, layer indices seen), filled in as the model runs."""
    problems: list[str] = []
    seen: list[int] = []
    served = csp_hf.attention_forward

    def checking(module, query, key, value, attention_mask, **kwargs):
        seen.append(getattr(module, "layer_idx", -1))
        out, weights = served(module, query, key, value, attention_mask, **kwargs)
        ref = _eager_on_same_inputs(module, query, key, value, attention_mask, kwargs)
        err, worst = rel_error(out.detach()[real_rows], ref[real_rows])
        if not err <= TOL[BF16]:
            problems.append(f"layer {getattr(module, 'layer_idx', '?')} attention output (real rows): err {err:.3e} "
                            f"> {TOL[BF16]:.1e} at {worst}")
        return out, weights

    monkeypatch.setattr(csp_hf, "attention_forward", checking)
    return problems, seen


@pytest.mark.parametrize("family", FAMILIES)
def test_cudnn_attn_implementation_served_and_equal_to_eager(hf, family, monkeypatch):
    state = _weights(hf, family)
    batch = _batch(LENGTHS)
    ref = _train_step(_build(hf, family, "eager", state, torch.float32), batch)
    yard = _train_step(_build(hf, family, "eager", state, BF16), batch)
    model = _build(hf, family, NAME, state, BF16)
    layer_problems, seen = _layer_checks(monkeypatch, batch[1].bool())
    cand = _train_step(model, batch)
    layers = model.config.num_hidden_layers
    for run in (ref, yard):
        assert run[2] == counters.Stats().to_dict(), f"eager attention must not reach the provider: {run[2]}"
    problems = _served(cand[2], layers) + layer_problems + _accuracy(ref, yard, cand)
    if len(seen) != layers:
        problems.append(f"the integration's attention function ran for layers {seen}, expected {layers} calls")
    assert not problems, _report(family, NAME, cand[2], problems)


def test_cudnn_attn_implementation_under_autocast(hf):
    """fp32 weights under bf16 autocast: HF's rotary leaves q/k fp32 and v bf16; the integration
    casts like F.sdpa does, and every layer is still served."""
    state = _weights(hf, "llama")
    batch = _batch(LENGTHS)
    ref = _train_step(_build(hf, "llama", "eager", state, torch.float32), batch)
    yard = _train_step(_build(hf, "llama", "eager", state, torch.float32), batch, autocast=True)
    model = _build(hf, "llama", NAME, state, torch.float32)
    cand = _train_step(model, batch, autocast=True)
    problems = _served(cand[2], model.config.num_hidden_layers) + _accuracy(ref, yard, cand)
    assert not problems, _report("llama (autocast)", NAME, cand[2], problems)


@pytest.mark.parametrize("family", ["llama"])
def test_attention_dropout_served(hf, family):
    """attention_dropout in training runs as cuDNN dropout (its own Philox stream: not comparable
    element by element with eager, so: served, finite, and different from no dropout)."""
    state = _weights(hf, family)
    batch = _batch(LENGTHS)
    model = _build(hf, family, NAME, state, BF16)
    loss_plain = _train_step(model, batch)[0]
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    loss, grads, delta = _train_step(model, batch)
    problems = _served(delta, model.config.num_hidden_layers)
    problems += [f"grad {n}: non-finite" for n, g in grads.items() if not torch.isfinite(g).all()]
    if not torch.isfinite(loss).all() or torch.equal(loss, loss_plain):
        problems.append(f"loss {loss.item()} (without dropout {loss_plain.item()})")
    assert not problems, _report(family, f"{NAME} with attention_dropout=0.1", delta, problems)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_oss"])  # gpt-oss: _supports_sdpa = False
def test_sdpa_attn_implementation_inside_enable_served_on_the_bias_path(hf, family):
    state = _weights(hf, family)
    batch = _batch(LENGTHS_SDPA)
    ref = _train_step(_build(hf, family, "eager", state, torch.float32), batch)
    yard = _train_step(_build(hf, family, "eager", state, BF16), batch)
    model = _build(hf, family, "sdpa", state, BF16)
    with csp.enable():
        cand = _train_step(model, batch)
    problems = _served(cand[2], model.config.num_hidden_layers) + _accuracy(ref, yard, cand)
    assert not problems, _report(family, "sdpa inside csp.enable()", cand[2], problems)


def test_left_padding_falls_back_then_is_served_by_the_provider_when_enabled(hf):
    """Left padding is not expressible as lengths: the integration runs transformers' sdpa with the
    boolean mask. Counted as attn_bias fallbacks by the integration when the provider is off;
    served by the provider's bias path (counted there, once) when it is on."""
    state = _weights(hf, "llama")
    ids, mask, labels = _batch(LENGTHS)
    left = (torch.flip(ids, [1]), torch.flip(mask, [1]), torch.flip(labels, [1]))
    first_real = (left[1].cumsum(-1) == 1) & (left[1] == 1)
    left = (left[0], left[1], left[2].masked_fill(first_real, -100))  # predicted from a padding row
    model = _build(hf, "llama", NAME, state, BF16)
    layers = model.config.num_hidden_layers
    _, _, off = _train_step(model, left)
    want = {"served": 0, "fallback": {"attn_bias": layers}}
    assert off["dense_fwd"] == want and off["dense_bwd"] == want, off
    with csp.enable():
        on = _train_step(model, left)
    ref = _train_step(_build(hf, "llama", "eager", state, torch.float32), left)
    yard = _train_step(_build(hf, "llama", "eager", state, BF16), left)
    problems = _served(on[2], layers) + _accuracy(ref, yard, on)
    assert not problems, _report("llama (left padding)", f"{NAME} inside csp.enable()", on[2], problems)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
def test_decode_steps_telemetry(hf, family):
    """generate(): the prefill (top-left) and every decode step (bottom-right diagonal) are served;
    gpt-oss decode steps have sinks at S_q == 1, which cuDNN does not support (sink_decode)."""
    state = _weights(hf, family)
    model = _build(hf, family, NAME, state, BF16).eval()
    ids, mask, _ = _batch((S, S, S))
    steps = 6
    before = counters.stats()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    delta = (counters.stats() - before).to_dict()
    layers = model.config.num_hidden_layers
    if family == "gpt_oss":
        want = {"served": layers, "fallback": {"sink_decode": layers * (steps - 1)}}
    else:
        want = {"served": layers * steps, "fallback": {}}
    assert delta["dense_fwd"] == want, f"{family}: expected dense_fwd {want}, telemetry {delta}"
    assert delta["dense_bwd"] == {"served": 0, "fallback": {}}, delta
