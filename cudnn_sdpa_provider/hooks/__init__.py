"""Layer 4, the hooks: where PyTorch calls in, and how the provider is switched on.

``overrides`` (the aten SDPA kernels), ``varlen_hooks`` (``torch_attn`` varlen ops), ``backends``
(the user's SDPA backend flags), ``activation`` (enable/disable), ``startup`` (the environment
variable's startup hook, imported by the shipped .pth file) and ``telemetry`` (the report file).
"""
