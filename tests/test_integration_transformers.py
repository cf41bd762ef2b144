"""CPU tier: the Hugging Face transformers integration (``attn_implementation="cudnn"``).

On the CPU every ``cudnn_sdpa_provider.attention`` call runs the aten reference composite and is
counted as ``no_cuda``; these tests check the wiring (masks, windows, sinks, GQA, lengths,
fallbacks, counting) against transformers' own eager attention in float32.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, length_terms
from cudnn_sdpa_provider.ops import reference
from cudnn_sdpa_provider.integrations import transformers as csp_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = csp_hf.DEFAULT_NAME
S = 24  # sequence length of the model tests
WINDOW = 6  # sliding window of the model tests (< S, so it matters)



def _no_cache(fn) -> dict:
    """transformers renamed create_*_mask's ``past_key_values`` to ``cache`` (the old name warns
    from 5.2x and goes in 5.40): pass "no cache" under whichever name this version takes."""
    import inspect

    return {"cache": None} if "cache" in inspect.signature(fn).parameters else {"past_key_values": None}

def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------ import, register


def test_importing_does_not_import_transformers():
    proc = _run("import sys, cudnn_sdpa_provider, cudnn_sdpa_provider.integrations.transformers as t\n"
                "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
                "assert callable(t.register)\nprint('ok')")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_register_without_transformers_raises_a_clear_import_error():
    proc = _run("import sys\nsys.modules['transformers'] = None  # as if not installed\n"
                "from cudnn_sdpa_provider.integrations import transformers as t\n"
                "try:\n    t.register()\nexcept ImportError as e:\n    print('IMPORT-ERROR:', e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "IMPORT-ERROR:" in proc.stdout and "pip install 'transformers>=5'" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def hf():
    tf = pytest.importorskip("transformers")
    registration = csp_hf.register()
    yield tf
    registration.remove()


def test_register_remove_and_argument_checks(hf):
    from transformers import masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    reg = csp_hf.register("cudnn_test_name")
    assert reg.active and "cudnn_test_name" in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert "cudnn_test_name" in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    again = csp_hf.register("cudnn_test_name", padding="right")  # replaces; the old handle no longer owns it
    assert not reg.active and again.active
    reg.remove()
    assert again.active, "removing a replaced registration must not remove the new one"
    again.remove()
    assert "cudnn_test_name" not in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert "cudnn_test_name" not in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    again.remove()  # idempotent
    with pytest.raises(ValueError, match="'sdpa'"):
        csp_hf.register("cudnn_sdpa")  # transformers treats any name containing "sdpa" as sdpa
    with pytest.raises(ValueError, match="already an attention implementation"):
        csp_hf.register("eager")
    with pytest.raises(ValueError, match=r"Valid choices: \['auto', 'right'\]"):
        csp_hf.register("cudnn_x", padding="left")
    with pytest.raises(ValueError, match="paged prefix"):
        csp_hf.register("paged|cudnn")


# ----------------------------------------------------------------------------- window semantics


@pytest.mark.parametrize("w", [1, 2, 5, 16])
@pytest.mark.parametrize("s_q,s_kv,q_offset", [(1, 1, 0), (9, 9, 0), (24, 24, 0), (3, 10, 7), (1, 12, 11)])
def test_hf_sliding_windows_are_the_documented_flash_windows(hf, w, s_q, s_kv, q_offset):
    """HF's sliding_window=W (causal) is FlashAttention (W-1, 0); the bidirectional one (W, W).
    The comparison is with the allowed-key mask of the package's reference, which the cuDNN graphs
    are tested against, at top-left and (with a cache offset) bottom-right alignment."""
    from transformers import masking_utils as mu

    bottom_right = csp_hf.diagonal((w, 0), s_q, s_kv, q_offset, 0)
    assert bottom_right is (s_q != s_kv)
    for fn, expect in ((mu.sliding_window_causal_mask_function(w), (w - 1, 0)),
                       (mu.sliding_window_bidirectional_mask_function(w), (w, w))):
        window = csp_hf.mask_window(fn, w, mu)
        assert window == expect
        hf_mask = mu.sdpa_mask(batch_size=1, q_length=s_q, kv_length=s_kv, q_offset=q_offset, mask_function=fn,
                               allow_is_causal_skip=False)
        ours = reference.allowed_mask(s_q, s_kv, window, bottom_right)
        assert torch.equal(hf_mask, ours), f"window {window}:\nHF\n{hf_mask.int()}\nours\n{ours.int()}"


def test_only_transformers_own_patterns_are_recognised(hf):
    from transformers import masking_utils as mu

    assert csp_hf.mask_window(mu.causal_mask_function, None, mu) == (-1, 0)
    assert csp_hf.mask_window(mu.bidirectional_mask_function, None, mu) == (-1, -1)
    sliding = mu.sliding_window_causal_mask_function(8)
    assert csp_hf.mask_window(sliding, 8, mu) == (7, 0)
    assert csp_hf.mask_window(sliding, 9, mu) is None, "a window must match local_size"
    assert csp_hf.mask_window(sliding, None, mu) is None
    overlay = mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(torch.ones(1, 4, dtype=torch.bool)))
    assert csp_hf.mask_window(overlay, None, mu) is None
    assert csp_hf.mask_window(mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)), 4, mu) is None
    assert csp_hf.mask_window(lambda b, h, q, kv: kv <= q, None, mu) is None
    assert csp_hf.diagonal((-1, 0), 4, 4, 0, 0) is False
    assert csp_hf.diagonal((-1, 0), 2, 6, 4, 0) is True
    assert csp_hf.diagonal((-1, 0), 2, 6, 3, 0) is None, "an offset that is neither top-left nor bottom-right"
    assert csp_hf.diagonal((-1, -1), 2, 6, 3, 0) is False, "no diagonal without a window"


# -------------------------------------------------------------------------- padding -> lengths


def _mask(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r] for r in rows])


@pytest.mark.parametrize("rows,right,none", [
    (["1111", "1111"], True, True),
    (["1111", "1100", "1000"], True, False),
    (["1111", "0011"], False, False),   # left padding
    (["1101", "1111"], False, False),   # a hole
    (["1111", "0000"], False, False),   # a row without tokens
])
def test_padding_lengths_classifies_right_padding(rows, right, none):
    key_mask = _mask(rows)
    seq_q, seq_kv, is_right, no_padding = csp_hf.padding_lengths(key_mask, (-1, 0), 4)
    assert bool(is_right) is right and bool(no_padding) is none
    assert seq_kv.dtype == torch.int32 and seq_kv.tolist() == key_mask.sum(-1).tolist()
    assert seq_q.tolist() == [4] * len(rows), "without a window every query row sees key 0"


def test_padding_lengths_keep_query_rows_that_see_a_key():
    key_mask = _mask(["11111111", "11100000", "10000000"])
    seq_q, seq_kv, _, _ = csp_hf.padding_lengths(key_mask, (2, 0), 8)  # each query sees itself and 2 before
    assert seq_kv.tolist() == [8, 3, 1]
    assert seq_q.tolist() == [8, 5, 3], "row i sees a real key iff i - 2 <= len - 1"
    allowed = reference.allowed_mask(8, 8, (2, 0), False, seq_len_q=torch.full((3,), 8), seq_len_kv=seq_kv)
    assert allowed.any(-1).squeeze(1).sum(-1).tolist() == seq_q.tolist()


def _config_for_masks(hf, sliding=None):
    cfg = hf.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    cfg.sliding_window = sliding
    cfg._attn_implementation = NAME
    return cfg


@pytest.mark.parametrize("sliding", [None, 3])
@pytest.mark.parametrize("case", ["none", "ones", "right", "left", "hole", "empty_row", "packed"])
def test_mask_builder_serves_right_padding_and_falls_back_otherwise(hf, case, sliding):
    from transformers import masking_utils as mu

    b, s = 3, 8
    masks = {"none": None, "packed": None, "ones": _mask(["1" * 8] * 3),
             "right": _mask(["11111111", "11111100", "10000000"]), "left": _mask(["11111111", "00111111", "00000001"]),
             "hole": _mask(["11111111", "11011111", "11111111"]), "empty_row": _mask(["11111111", "11110000", "0" * 8])}
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * b) if case == "packed" else None
    embeds = torch.zeros(b, s, 32)
    create = mu.create_causal_mask if sliding is None else mu.create_sliding_window_causal_mask
    built = create(config=_config_for_masks(hf, sliding), inputs_embeds=embeds, attention_mask=masks[case],
                   **_no_cache(create), position_ids=position_ids)
    window = (-1, 0) if sliding is None else (sliding - 1, 0)
    if case in ("none", "ones", "right"):
        assert isinstance(built, csp_hf.CudnnMask), type(built)
        assert built.window == window and built.bottom_right is False and built.shape == (b, s, s)
        if case == "right":
            assert built.seq_lens_kv.tolist() == [8, 6, 1]
            assert built.seq_lens_q.tolist() == ([8, 8, 8] if sliding is None else [8, 8, 3])
            made = []  # marked as the builder's own: every layer shares their row terms (core/length_terms.py)
            for _ in range(2):
                length_terms.get(built.seq_lens_q, built.seq_lens_kv, ("term",), lambda: made.append(1))
            assert made == [1]
            # read on the host: every query length is S and every key length in [1, S] -- stated only
            # without a left bound (a sliding window's query lengths are not S)
            assert length_terms.full(built.seq_lens_q, built.seq_lens_kv, s, s) is (sliding is None)
        else:
            assert built.seq_lens_q is None and built.seq_lens_kv is None
    else:
        assert isinstance(built, torch.Tensor) and built.dtype == torch.bool and built.shape == (b, 1, s, s)
    # Whatever the route, the mask means exactly what transformers' sdpa mask means.
    cfg = _config_for_masks(hf, sliding)
    cfg._attn_implementation = "sdpa"
    want = create(config=cfg, inputs_embeds=embeds, attention_mask=masks[case], **_no_cache(create),
                  position_ids=position_ids, allow_is_causal_skip=False)
    got = built.to_bool() if isinstance(built, csp_hf.CudnnMask) else built
    assert torch.equal(got, want)


def test_padding_right_policy_asserts_on_the_device_instead_of_guessing(hf):
    from transformers import masking_utils as mu

    registration = csp_hf.register("cudnn_right", padding="right")
    try:
        cfg = _config_for_masks(hf)
        cfg._attn_implementation = "cudnn_right"
        embeds = torch.zeros(2, 4, 32)
        built = mu.create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=_mask(["1111", "1100"]),
                                      **_no_cache(mu.create_causal_mask))
        assert isinstance(built, csp_hf.CudnnMask) and built.seq_lens_kv.tolist() == [4, 2]
        # nothing read on the host: no word that every row is live (core/length_terms.full)
        assert not length_terms.full(built.seq_lens_q, built.seq_lens_kv, 4, 4)
        with pytest.raises(RuntimeError, match="not right-padded"):
            mu.create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=_mask(["1111", "0011"]),
                                  **_no_cache(mu.create_causal_mask))
    finally:
        registration.remove()


# ------------------------------------------------------------------------------------ models

COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, attention_dropout=0.0)


def _config(hf, family: str):
    if family == "llama":  # GQA, causal
        return hf.LlamaConfig(num_hidden_layers=2, **COMMON)
    if family == "qwen2":  # one full layer, then sliding layers
        return hf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                              **COMMON)
    if family == "mistral":  # sliding window in every layer
        return hf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON)
    if family == "gemma3":  # alternating sliding / full, q/k norms, query_pre_attn_scalar scaling
        return hf.Gemma3TextConfig(num_hidden_layers=2, sliding_window=WINDOW, sliding_window_pattern=2,
                                   query_pre_attn_scalar=24, **COMMON)
    if family == "gemma2_softcap":  # attention logit soft-capping: falls back
        return hf.Gemma2Config(num_hidden_layers=2, sliding_window=WINDOW, attn_logit_softcapping=20.0,
                               query_pre_attn_scalar=16, **COMMON)
    if family == "gpt_oss":  # sinks, alternating sliding / full, MoE with every expert active
        return hf.GptOssConfig(num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    raise ValueError(family)


def _models(hf, family: str, impls=("eager", NAME)):
    torch.manual_seed(0)
    cfg = _config(hf, family)
    models = [hf.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl) for impl in impls]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


def _batch(padding: str, b: int = 3, s: int = S):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, COMMON["vocab_size"], (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.long)
    lengths = [s, s - 5, max(2, s - 15)]  # at S=24 the last row has more padding than the window
    for row, n in enumerate(lengths):
        if padding == "right":
            mask[row, n:] = 0
        elif padding == "left":
            mask[row, : s - n] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if padding == "left":  # the label of the first real token is predicted from a padding row
        first = (mask.cumsum(-1) == 1) & (mask == 1)
        labels = labels.masked_fill(first, -100)
    return ids, (mask if padding != "none" else None), labels


def _step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    before = counters.stats()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    delta = (counters.stats() - before).to_dict()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, delta


def _rel(actual, ref) -> float:
    return ((actual.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _assert_matches(ref, got, mask, tol=1e-4):
    loss_r, logits_r, grads_r, _ = ref
    loss_g, logits_g, grads_g, delta = got
    real = mask.bool() if mask is not None else torch.ones(logits_r.shape[:2], dtype=torch.bool)
    assert _rel(loss_g, loss_r) < tol, (loss_g, loss_r, delta)
    assert _rel(logits_g[real], logits_r[real]) < tol, f"logits of real tokens differ; telemetry {delta}"
    assert set(grads_g) == set(grads_r)
    worst = max(grads_r, key=lambda n: _rel(grads_g[n], grads_r[n]))
    assert _rel(grads_g[worst], grads_r[worst]) < tol, f"grad {worst}: {_rel(grads_g[worst], grads_r[worst]):.2e}; " \
                                                       f"telemetry {delta}"


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3", "gpt_oss"])
def test_model_matches_eager_and_every_layer_runs_on_the_provider(hf, family, padding):
    eager, ours = _models(hf, family)
    ids, mask, labels = _batch(padding)
    ref = _step(eager, ids, mask, labels)
    got = _step(ours, ids, mask, labels)
    layers = ours.config.num_hidden_layers
    delta = got[3]
    assert delta["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": layers}}, delta
    assert delta["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": layers}}, delta
    assert ref[3]["dense_fwd"] == {"served": 0, "fallback": {}}, "eager must not touch the provider"
    _assert_matches(ref, got, mask)


@pytest.mark.parametrize("family,windows,sinks", [
    ("llama", [(-1, 0)] * 2, False),
    ("qwen2", [(-1, 0), (WINDOW - 1, 0), (WINDOW - 1, 0)], False),
    ("gemma3", [(WINDOW - 1, 0), (-1, 0)], False),
    ("gpt_oss", [(WINDOW - 1, 0), (-1, 0)], True),
])
def test_layers_call_the_provider_with_native_gqa_their_window_and_sinks(hf, family, windows, sinks, monkeypatch):
    from cudnn_sdpa_provider import functional

    calls = []
    real = functional.attention

    def spy(q, k, v, **options):
        calls.append((q.shape[1], k.shape[1], v.shape[1], options))
        return real(q, k, v, **options)

    monkeypatch.setattr(functional, "attention", spy)
    _, ours = _models(hf, family)
    ids, mask, labels = _batch("right")
    _step(ours, ids, mask, labels)
    assert [c[:3] for c in calls] == [(4, 2, 2)] * len(windows), "GQA must reach the provider without repeat_kv"
    assert [c[3]["window"] for c in calls] == windows
    for *_, options in calls:
        assert options["bottom_right"] is False
        assert options["seq_lens_kv"].tolist() == mask.sum(-1).tolist()
        assert (options["sinks"] is not None) is sinks
        if sinks:
            assert options["sinks"].requires_grad and options["sinks"].shape == (4,)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
def test_left_padding_falls_back_counted_and_correct(hf, family):
    eager, ours = _models(hf, family)
    ids, mask, labels = _batch("left")
    ref = _step(eager, ids, mask, labels)
    got = _step(ours, ids, mask, labels)
    layers = ours.config.num_hidden_layers
    assert got[3]["dense_fwd"] == {"served": 0, "fallback": {"attn_bias": layers}}, got[3]
    assert got[3]["dense_bwd"] == {"served": 0, "fallback": {"attn_bias": layers}}, got[3]
    _assert_matches(ref, got, mask)


def test_left_padding_inside_enable_is_counted_once_by_the_provider(hf):
    eager, ours = _models(hf, "llama")
    ids, mask, labels = _batch("left")
    with csp.enable():
        got = _step(ours, ids, mask, labels)
    layers = ours.config.num_hidden_layers
    delta = got[3]
    fwd = delta["dense_fwd"]["served"] + sum(delta["dense_fwd"]["fallback"].values())
    assert fwd == layers, f"each attention call counted exactly once: {delta}"
    assert "attn_bias" not in delta["dense_fwd"]["fallback"], delta
    _assert_matches(_step(eager, ids, mask, labels), got, mask)


def test_softcap_falls_back_to_the_models_eager_attention(hf):
    eager, ours = _models(hf, "gemma2_softcap")
    ids, mask, labels = _batch("right")
    ref = _step(eager, ids, mask, labels)
    got = _step(ours, ids, mask, labels)
    assert got[3]["dense_fwd"] == {"served": 0, "fallback": {"softcap": 2}}, got[3]
    assert got[3]["dense_bwd"] == {"served": 0, "fallback": {"softcap": 2}}, got[3]
    _assert_matches(ref, got, mask, tol=1e-6)


def test_softcap_fallback_raises_in_strict_mode(hf):
    _, ours = _models(hf, "gemma2_softcap")
    ids, mask, labels = _batch("none")
    with csp.enable(strict=True), pytest.raises(csp.FallbackError) as info:
        ours(input_ids=ids, attention_mask=mask, labels=labels)
    assert info.value.reasons == ["softcap"] and info.value.path == "dense_fwd"


def test_attention_dropout_is_served_and_reproducible(hf):
    torch.manual_seed(0)
    cfg = _config(hf, "llama")
    cfg.attention_dropout = 0.25
    model = hf.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).train()
    ids, mask, labels = _batch("right")
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(_step(model, ids, mask, labels))
    loss, _, grads, delta = runs[0]
    assert delta["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 2}}, delta
    assert delta["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": 2}}, delta
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert torch.equal(runs[1][0], loss), "the same seed gives the same dropout masks"
    model.eval()  # transformers passes dropout only in training mode
    assert not torch.equal(_step(model, ids, mask, labels)[0], loss), "dropout must have changed the result"


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_matches_eager(hf, family, padding):
    """Decoding with a cache: bottom-right diagonals (served), left padding (falls back)."""
    eager, ours = (m.eval() for m in _models(hf, family))
    ids, mask, _ = _batch(padding, s=10)
    if mask is None:
        mask = torch.ones_like(ids)
    before = counters.stats()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)
    ref, got = eager.generate(**kwargs), ours.generate(**kwargs)
    delta = (counters.stats() - before).to_dict()
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores):
        assert _rel(b, a) < 1e-4
    calls = ours.config.num_hidden_layers * 8
    assert sum(delta["dense_fwd"]["fallback"].values()) == calls, delta
    if padding == "none":
        assert delta["dense_fwd"]["fallback"] == {"no_cuda": calls}, "every decode step is served"


def test_autocast_casts_query_key_value_like_sdpa(hf):
    """Under autocast HF's rotary embedding leaves q, k in float32 and v in bfloat16 (F.sdpa casts)."""
    sdpa, ours = _models(hf, "llama", impls=("sdpa", NAME))
    ids, mask, labels = _batch("right")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _step(sdpa, ids, mask, labels)
        got = _step(ours, ids, mask, labels)
    assert got[3]["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 2}}, got[3]
    _assert_matches(ref, got, mask, tol=3e-2)


# ----------------------------------------------------------------------- the attention function


class _Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


@pytest.mark.parametrize("s_q,s_kv,causal", [(5, 5, True), (1, 6, True), (5, 5, False), (4, 9, True)])
def test_attention_function_without_mask_means_what_sdpa_means(hf, s_q, s_kv, causal):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(2)
    q = torch.randn(2, 4, s_q, 16)
    k, v = torch.randn(2, 2, s_kv, 16), torch.randn(2, 2, s_kv, 16)
    layer = _Layer()
    got, weights = csp_hf.attention_forward(layer, q, k, v, None, scaling=0.3, is_causal=causal)
    want, _ = sdpa_attention_forward(layer, q, k, v, None, scaling=0.3, is_causal=causal)
    assert weights is None and got.shape == (2, s_q, 4, 16) and got.is_contiguous()
    assert _rel(got, want) < 1e-5


def test_attention_function_refuses_a_mask_built_for_another_shape(hf):
    mask = csp_hf.CudnnMask((-1, 0), False, (2, 5, 5))
    q = torch.randn(2, 4, 6, 16)
    with pytest.raises(ValueError, match=r"built for \(B, S_q, S_kv\) = \(2, 5, 5\)"):
        csp_hf.attention_forward(_Layer(), q, q[:, :2], q[:, :2], mask)
