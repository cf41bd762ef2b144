"""Hugging Face transformers (5.x): an ``attn_implementation`` that runs on cuDNN graphs.

    from transformers import AutoModelForCausalLM
    from cudnn_sdpa_provider.integrations import transformers as csp_hf

    csp_hf.register()                  # once per process; returns a handle with .remove()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cudnn")

How it plugs in. ``register(name="cudnn", padding="auto")`` adds two functions under ``name`` to
transformers' process-wide registries: ``attention_forward`` (``AttentionInterface``; every
attention layer calls it with ``module, query, key, value, attention_mask, dropout, scaling,
sliding_window, s_aux, ...`` and it returns ``(out (B, S_q, H, D_v), None)`` like
``sdpa_attention_forward``) and ``build_mask`` (``AttentionMaskInterface``). The mask builder is
required: for a name without one, ``create_causal_mask`` returns None and padding would be lost.
Where the mask transformers asks for can be expressed for cuDNN, the builder returns a small
``CudnnMask`` (the pattern as a FlashAttention window, its diagonal alignment, per-sequence
lengths; one per forward and mask type); where it cannot, it returns exactly the boolean mask
transformers' ``sdpa`` would get, and the attention function falls back.

The name must not contain ``sdpa``, ``flash`` or ``flex``: transformers 5 matches these
substrings (``"sdpa" in attn_implementation`` in ``get_correct_attn_implementation``) and applies
that backend's checks; e.g. it refuses gpt-oss (``_supports_sdpa = False``) for "cudnn_sdpa".

Served by ``cudnn_sdpa_provider.attention`` (ops ``cudnn_sdpa::dense_fwd/dense_bwd``, counted as
served on CUDA, or as a fallback with the engine's own reason: ``dtype`` for fp32, ``sink_decode``
for sinks at S_q == 1, ``no_cuda`` on the CPU, ...) when all of these hold:

1. Pattern: one of transformers' own mask functions, recognised by comparing code objects and
   closure values with the functions transformers builds: causal; sliding-window causal (HF's
   ``sliding_window=W`` is ``kv_idx > q_idx - W``, the last W keys including the diagonal, i.e.
   window ``(W - 1, 0)``); bidirectional; bidirectional sliding window (``|q_idx - kv_idx| <= W``,
   i.e. ``(W, W)``). The CPU tests compare these windows with HF's masks element by element.
   The window is taken from the mask of the layer's type (``layer_types``: gpt-oss, Gemma and
   Qwen2 alternate), never from the ``sliding_window`` argument, so it is what eager computes.
2. Diagonal: top-left (no cache, or an empty one) or bottom-right (DynamicCache decoding: the
   last query and the last key are the same position).
3. Padding: none, or right padding of the keys (every row a prefix of real tokens, at least one)
   without a cache offset. It becomes ``seq_lens_kv`` = real tokens and ``seq_lens_q`` = the
   query rows that see at least one real key (all rows; ``len + W - 1`` in sliding layers).
   Padding rows that see real keys are computed as transformers computes them; rows that see no
   key at all are 0 (eager gives a uniform average there, sdpa 0; no real token depends on
   them). An all-ones mask is no padding.
4. No ``softcap`` (attention logit soft-capping) and no ``position_bias``.

Sinks (gpt-oss passes ``s_aux=module.sinks``; they get their gradient), grouped-query attention
(no ``repeat_kv``) and attention dropout (``attention_dropout`` in training, as ``dropout_p``:
cuDNN's Philox stream, so masks differ from eager's, reproducibly under ``torch.manual_seed``)
are served. Under autocast q, k, v are cast to the autocast dtype, as
F.scaled_dot_product_attention does (HF's rotary embedding can leave q, k fp32 and v bf16).

Deciding 3 for a mask on the GPU needs its contents. ``padding="auto"`` (default) reads ONE
2-element flag per mask type and forward (never per layer; transformers' own sdpa and flash mask
builders make a comparable read) and never reads while tracing (torch.compile, CUDA-graph
capture), where any 2-D mask, even all ones, falls back. ``padding="right"`` never reads for
prefill/training: the caller promises right padding and ``torch._assert_async`` checks it on the
device, so a left-padded batch fails loudly instead of being computed as something else (with a
cache offset it behaves like "auto").

Falls back (correct, counted with a reason):

* ``attn_bias``: left padding; a row with no real token; padding together with a cache offset;
  packed sequences (detected by transformers from ``position_ids``); ``or_mask_function`` /
  ``and_mask_function`` overlays (image tokens, Gemma 3 bidirectional); chunked attention;
  StaticCache (tensor) offsets; a 4-D mask passed by the caller; padding while tracing with
  ``padding="auto"``; a ``position_bias``.
* ``softcap``: attention logit soft-capping (e.g. Gemma 2's default ``attn_logit_softcapping=50``).

A fallback runs transformers' ``sdpa_attention_forward`` with the sdpa mask, or, with sinks or
softcap (which sdpa ignores), the layer's own ``eager_attention_forward``. Inside
``csp.enable()`` the sdpa call goes through the provider's overrides, which count it (its
boolean mask is then served on the cuDNN bias path); otherwise, and always for eager, this
module counts it: forward, and backward through a gradient hook. Each attention call is counted
once. In strict mode an eager fallback raises ``FallbackError``.

Also: ``attention_mask=None`` (a model that builds no mask) means what it means to sdpa: causal,
top-left, when the layer is causal and S_q > 1, else full; served. Attention weights are not
returned (None, as with sdpa). Paged attention (``"paged|<name>"``) is not registered.
Importing this module imports neither transformers nor the package's engine; ``register()``
imports transformers and raises ImportError naming what to install when it is missing.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["register", "Registration", "CudnnMask", "DEFAULT_NAME", "PADDING_POLICIES"]

log = logging.getLogger("cudnn_sdpa_provider")

#: The ``attn_implementation`` name ``register()`` uses by default.
DEFAULT_NAME = "cudnn"
#: Substrings transformers interprets in an implementation name (see the module docstring).
_HF_SUBSTRINGS = ("sdpa", "flash", "flex")
#: Values of ``register(padding=...)``.
PADDING_POLICIES = ("auto", "right")
_MIN_MAJOR = 5
_MARK = "_cudnn_sdpa_provider"


@functools.cache  # a failed import raises and is not cached
def _transformers():
    """transformers' modules this integration uses, or an ImportError that says what to install."""
    try:
        import transformers
        from transformers import masking_utils
        from transformers.integrations import sdpa_attention
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            "cudnn_sdpa_provider.integrations.transformers needs Hugging Face transformers >= 5.0, which is not "
            f"importable ({exc}). Install it with: pip install 'transformers>=5'"
        ) from exc
    major = int(transformers.__version__.split(".")[0])
    if major < _MIN_MAJOR:
        raise ImportError(f"cudnn_sdpa_provider.integrations.transformers needs transformers >= {_MIN_MAJOR}.0 "
                          f"(AttentionMaskInterface, masking_utils); found {transformers.__version__}")
    return transformers, masking_utils, sdpa_attention, AttentionInterface


# ------------------------------------------------------------------------------------ the mask


@dataclass(frozen=True, eq=False)
class CudnnMask:
    """The mask of one forward for one mask type, as the builder hands it to the attention layers.

    ``window`` is the FlashAttention (left, right) window of the pattern, ``bottom_right`` its
    diagonal alignment, ``shape`` the (B, S_q, S_kv) it was built for. ``seq_lens_q`` and
    ``seq_lens_kv`` are (B,) int32 device tensors for a right-padded batch (None: no padding).
    ``to_bool()`` builds, once, the boolean mask transformers' ``sdpa`` would get (for fallbacks).
    """

    window: tuple[int, int]
    bottom_right: bool
    shape: tuple[int, int, int]
    seq_lens_q: torch.Tensor | None = None
    seq_lens_kv: torch.Tensor | None = None
    materialize: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def to_bool(self, device=None) -> torch.Tensor:
        """(B, 1, S_q, S_kv) bool, True = attend: transformers' sdpa mask for this call (built once)."""
        if "bool" not in self._cache:
            self._cache["bool"] = self.materialize()
        return _on(self._cache["bool"], device)

    def check(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """Refuse to describe a call it was not built for (a wrong mask must never be applied)."""
        got = (query.shape[0], query.shape[2], key.shape[2])
        if got != self.shape:
            raise ValueError(f"CudnnMask was built for (B, S_q, S_kv) = {self.shape} but the attention call has "
                             f"{got}; the model changed the sequence between mask creation and attention")


def _on(t, device):
    """``t`` on ``device`` (layers of a model split over devices get the mask of the first one)."""
    return t if t is None or device is None or t.device == device else t.to(device, non_blocking=True)


def _same_value(a, b) -> bool:
    if callable(a) or callable(b):
        return callable(a) and callable(b) and _same_function(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if type(a) is type(b) and isinstance(a, (int, float, str, bool, type(None))):
        return a == b
    return False  # tensors (packed-sequence ids, padding) and anything unknown: not a known pattern


def _same_function(f, g) -> bool:
    """``f`` is ``g`` or the same closure built with equal plain values (recursively)."""
    if f is g:
        return True
    code = getattr(f, "__code__", None)
    if code is None or code is not getattr(g, "__code__", None):
        return False
    if not _same_value(getattr(f, "__defaults__", None), getattr(g, "__defaults__", None)):
        return False
    cf, cg = f.__closure__ or (), g.__closure__ or ()
    try:
        return len(cf) == len(cg) and all(_same_value(a.cell_contents, b.cell_contents) for a, b in zip(cf, cg))
    except ValueError:  # an empty cell
        return False


def mask_window(mask_function, local_size, masking_utils) -> tuple[int, int] | None:
    """The FlashAttention window of one of transformers' own mask functions, else None."""
    mu = masking_utils
    if mask_function is mu.causal_mask_function:
        return (-1, 0)
    if mask_function is mu.bidirectional_mask_function:
        return (-1, -1)
    if type(local_size) is int and local_size >= 1:
        # kv_idx > q_idx - W: the last W keys including the diagonal -> left bound W - 1.
        if _same_function(mask_function, mu.sliding_window_causal_mask_function(local_size)):
            return (local_size - 1, 0)
        # |q_idx - kv_idx| <= W on both sides.
        if _same_function(mask_function, mu.sliding_window_bidirectional_mask_function(local_size)):
            return (local_size, local_size)
    return None


def diagonal(window, q_length, kv_length, q_offset, kv_offset) -> bool | None:
    """bottom_right for cuDNN, or None when the diagonal offset is neither top-left nor bottom-right."""
    if window == (-1, -1):
        return False  # no diagonal
    offset = q_offset - kv_offset  # query i sits at key index i + offset
    if offset == 0:
        return False
    return True if offset == kv_length - q_length else None


def padding_lengths(key_mask: torch.Tensor, window: tuple[int, int], q_length: int):
    """Device-side, no sync: (seq_lens_q, seq_lens_kv, right_padded, no_padding) for a (B, S_kv) key mask.

    ``right_padded`` (0-dim bool) holds when every row is a prefix of ones with at least one one;
    ``seq_lens_q`` keeps the query rows that see at least one real key (rows past it see none and
    are 0 in cuDNN's padded output, as in torch SDPA; without a window every row sees key 0).
    """
    key_mask = key_mask.bool()
    lengths = key_mask.sum(-1, dtype=torch.int32)
    prefix = torch.arange(key_mask.shape[-1], device=key_mask.device) < lengths[:, None]
    right_padded = (key_mask == prefix).all() & (lengths > 0).all()
    no_padding = key_mask.all()
    left = window[0]
    if left < 0:
        seq_q = torch.full_like(lengths, q_length)
    else:
        seq_q = (lengths + left).clamp(max=q_length)
    return seq_q, lengths, right_padded, no_padding


def _key_mask(attention_mask, kv_length, kv_offset):
    """The (B, kv_length) slice of a 2-D padding mask that keys kv_offset.. use (padded with False)."""
    need = kv_offset + kv_length - attention_mask.shape[-1]
    if need > 0:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, need), value=False)
    return attention_mask[:, kv_offset : kv_offset + kv_length]


def _tracing(t: torch.Tensor) -> bool:
    try:
        from transformers.utils.import_utils import is_tracing

        return bool(is_tracing(t))
    except ImportError:  # pragma: no cover - transformers without is_tracing
        capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
        return torch.compiler.is_compiling() or torch.jit.is_tracing() or capturing


def build_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
               local_size=None, *, padding="auto", **kwargs):
    """The mask builder registered with AttentionMaskInterface: a CudnnMask, or the sdpa mask."""
    _, mu, _, _ = _transformers()
    mask_function = mu.causal_mask_function if mask_function is None else mask_function

    def materialize():
        # Exactly what transformers' sdpa path would get, never skipped (skipping reads the device).
        options = dict(kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                            local_size=local_size, **options)

    window = mask_window(mask_function, local_size, mu)
    if window is None:
        return _unserved(materialize, "a mask function that is not one of transformers' plain patterns")
    if type(q_offset) is not int or type(kv_offset) is not int:
        return _unserved(materialize, "a tensor cache offset (StaticCache)")
    bottom_right = diagonal(window, q_length, kv_length, q_offset, kv_offset)
    if bottom_right is None:
        return _unserved(materialize, f"a diagonal offset cuDNN cannot align (q_offset={q_offset}, kv_offset="
                                      f"{kv_offset}, S_q={q_length}, S_kv={kv_length})")
    shape = (batch_size, q_length, kv_length)
    served = CudnnMask(window, bottom_right, shape, materialize=materialize)
    if attention_mask is None:
        return served
    seq_q, seq_kv, right_padded, no_padding = padding_lengths(_key_mask(attention_mask, kv_length, kv_offset), window,
                                                              q_length)
    # Lengths only without a cache offset: cuDNN aligns a padded diagonal to each sequence's end.
    lengths_apply = not bottom_right and kv_offset == 0
    padded = CudnnMask(window, False, shape, seq_q, seq_kv, materialize=materialize)
    tracing = _tracing(seq_kv)
    if padding == "right" and lengths_apply:
        torch._assert_async(right_padded, "cudnn attention (padding='right'): the attention mask is not right-padded")
        return padded if tracing else _owned(padded)
    if tracing:
        return _unserved(materialize, "a padding mask while tracing (padding='auto' reads it; use padding='right')")
    right, none = torch.stack([right_padded, no_padding]).tolist()  # the one device read
    if none:
        return served
    if right and lengths_apply:  # read here: every key length in [1, kv_length]
        return _owned(padded, full=(q_length, kv_length) if window[0] < 0 else None)
    return _unserved(materialize, "a padding mask that is not right padding" if lengths_apply else
                     "padding together with a cache offset (cuDNN aligns padded rows per sequence)")


def _owned(mask: CudnnMask, full: tuple[int, int] | None = None) -> CudnnMask:
    """``mask``, its lengths marked as made here (core/length_terms.py): every layer of the forward
    gets them, so their row terms are computed once, not per layer (the caller is not tracing).
    ``full``: (S_q, S_kv) where the caller read that every key length is in [1, S_kv] and the query
    lengths are S_q (``length_terms.own``)."""
    from ..core import length_terms

    length_terms.own(mask.seq_lens_q, mask.seq_lens_kv, full=full)
    return mask


def _unserved(materialize, detail: str) -> torch.Tensor:
    from ..core import counters

    counters.log_once(("transformers", "mask", detail), logging.INFO,
                      "transformers integration: attention with %s falls back (attn_bias)", detail)
    return materialize()


# ----------------------------------------------------------------------------- the attention


def _autocast(query, key, value):
    """Cast like F.scaled_dot_product_attention under autocast (HF's rotary can leave q/k fp32, v bf16)."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return query.to(dtype), key.to(dtype), value.to(dtype)
    return query, key, value


def _options(module, query, key, attention_mask, is_causal):
    """Keyword options for csp.attention, or a (reason, detail) fallback."""
    if isinstance(attention_mask, CudnnMask):
        attention_mask.check(query, key)
        return dict(window=attention_mask.window, bottom_right=attention_mask.bottom_right,
                    seq_lens_q=_on(attention_mask.seq_lens_q, query.device),
                    seq_lens_kv=_on(attention_mask.seq_lens_kv, query.device))
    if attention_mask is None:  # sdpa's meaning: top-left causal for a causal layer with S_q > 1
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        return dict(window=(-1, 0) if (causal and query.shape[2] > 1) else (-1, -1))
    return ("attn_bias", f"a materialized attention mask {tuple(attention_mask.shape)} {attention_mask.dtype}")


def _feature_reason(kwargs):
    if kwargs.get("softcap") is not None:
        return "softcap", f"attention logit soft-capping (softcap={kwargs['softcap']})"
    if kwargs.get("position_bias") is not None:
        return "attn_bias", "a position_bias (relative attention bias)"
    return None


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The attention function registered with AttentionInterface: (out (B, S_q, H, D_v), None)."""
    from .. import functional

    options = _options(module, query, key, attention_mask, is_causal)
    reason = _feature_reason(kwargs) or (options if isinstance(options, tuple) else None)
    if reason is not None:
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, reason)
    q, k, v = _autocast(query, key, value)
    out = functional.attention(q, k, v, scale=scaling, sinks=kwargs.get("s_aux"), dropout_p=float(dropout or 0.0),
                               **options)
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------- fallbacks


def _eager_function(module):
    """The model's own eager attention (what attn_implementation='eager' runs for this layer)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(f"{type(module).__name__} needs an eager fallback (sinks or softcap) but its module "
                                  f"{type(module).__module__} has no eager_attention_forward; use "
                                  "attn_implementation='eager' for this model")
    return fn


def _additive(mask, query, key, module, is_causal):
    """The eager functions' additive mask: 0 where attended, finfo.min elsewhere (as eager_mask)."""
    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not (causal and query.shape[2] > 1):
            return None
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask,
                                                                                        torch.finfo(query.dtype).min)


def _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, reason):
    from ..hooks import activation
    from ..ops import route

    slug, detail = reason
    mask = attention_mask.to_bool(query.device) if isinstance(attention_mask, CudnnMask) else attention_mask
    eager = kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None
    # The provider counts an sdpa call itself while it is enabled; everything else is counted here.
    counted_here = eager or not activation.enabled()

    def native(_reason=None):
        if eager:
            out, weights = _eager_function(module)(module, query, key, value,
                                                   _additive(mask, query, key, module, is_causal), dropout=dropout,
                                                   scaling=scaling, **kwargs)
        else:
            _, _, sdpa_attention, _ = _transformers()
            out, weights = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                                                 scaling=scaling, is_causal=is_causal, **kwargs)
        if counted_here and out.requires_grad:
            out.register_hook(lambda grad: route.call("dense_bwd", route.fixed(slug, detail), None, lambda r: None,
                                                      lambda: "", strict=False))
        return out, weights

    if not counted_here:
        return native()
    layer = type(module).__name__
    return route.call("dense_fwd", route.fixed(slug, detail), None, native, lambda: route.describe_call(
        layer=layer, query=query, key=key, value=value, dropout=dropout))


# ------------------------------------------------------------------------------ registration


class Registration:
    """One ``register()``: ``remove()`` takes this name out of both transformers registries."""

    def __init__(self, name: str, attention_fn, mask_fn):
        self.name = name
        self._attention_fn = attention_fn
        self._mask_fn = mask_fn

    @property
    def active(self) -> bool:
        _, mu, _, attention_interface = _transformers()
        return (attention_interface._global_mapping.get(self.name) is self._attention_fn
                and mu.AttentionMaskInterface._global_mapping.get(self.name) is self._mask_fn)

    def remove(self) -> None:
        """Unregister (only what this handle registered; a later register() of the name stays)."""
        _, mu, _, attention_interface = _transformers()
        for mapping, fn in ((attention_interface._global_mapping, self._attention_fn),
                            (mu.AttentionMaskInterface._global_mapping, self._mask_fn)):
            if mapping.get(self.name) is fn:
                del mapping[self.name]

    def __repr__(self) -> str:
        return f"Registration(name={self.name!r}, active={self.active})"


def register(name: str = DEFAULT_NAME, *, padding: str = "auto") -> Registration:
    """Make ``attn_implementation=name`` run attention on cuDNN graphs (see the module docstring).

    Registering a name again replaces the earlier registration. ``padding`` is one of
    ``PADDING_POLICIES``: ``"auto"`` (one device read per mask type and forward) or ``"right"``
    (no read; a device-side assertion checks the batch is right-padded).
    """
    _, mu, _, attention_interface = _transformers()
    if not isinstance(name, str) or not name or "|" in name or "/" in name:
        raise ValueError(f"name must be a non-empty string without '|' or '/' (transformers' paged prefix and hub "
                         f"kernel syntax), got {name!r}")
    clash = [s for s in _HF_SUBSTRINGS if s in name.lower()]
    if clash:
        raise ValueError(f"name {name!r} contains {clash[0]!r}, which transformers matches as a substring and treats "
                         f"as its own {clash[0]} backend (e.g. 'sdpa' in the name makes it refuse gpt-oss); use a name "
                         f"without {list(_HF_SUBSTRINGS)}, e.g. the default {DEFAULT_NAME!r}")
    if padding not in PADDING_POLICIES:
        raise ValueError(f"Unknown padding policy {padding!r}. Valid choices: {list(PADDING_POLICIES)}")
    current = attention_interface._global_mapping.get(name)
    if name == "eager" or (current is not None and not getattr(current, _MARK, False)):
        raise ValueError(f"{name!r} is already an attention implementation of transformers or another library; "
                         f"register under another name (default {DEFAULT_NAME!r})")

    def cudnn_attention(module, query, key, value, attention_mask, **kwargs):
        # Looked up at call time, so a test can wrap attention_forward.
        return attention_forward(module, query, key, value, attention_mask, **kwargs)

    def cudnn_attention_mask(*args, **kwargs):
        return build_mask(*args, padding=padding, **kwargs)

    for fn in (cudnn_attention, cudnn_attention_mask):
        setattr(fn, _MARK, True)
    attention_interface.register(name, cudnn_attention)
    mu.AttentionMaskInterface.register(name, cudnn_attention_mask)
    log.info("cudnn_sdpa_provider: registered attn_implementation=%r with transformers (padding=%r)", name, padding)
    return Registration(name, cudnn_attention, cudnn_attention_mask)
