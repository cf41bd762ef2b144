"""Integrations of the provider with model libraries. Each is a submodule imported on demand.

``cudnn_sdpa_provider.integrations.transformers``
    Hugging Face transformers (5.x): ``register()`` adds an ``attn_implementation`` (default
    name ``"cudnn"``) whose attention layers run on ``cudnn_sdpa_provider.attention``:
    GQA without repeat_kv, causal and sliding-window layers, gpt-oss attention sinks (with their
    gradient), right-padded batches as per-sequence lengths. Its docstring lists exactly what is
    served and what falls back, and why.

Importing this package (or any submodule) imports no model library; a library is imported when
its integration is used, and a missing one raises ImportError naming the package to install.
"""
