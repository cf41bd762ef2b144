"""Layer 4, the hooks: where PyTorch calls in, and how the provider is switched on.

``overrides`` (the aten SDPA kernels), ``varlen_hooks`` (``torch_attn`` varlen ops), ``backends``
(the user's SDPA backend flags), ``activation`` (enable/disable), ``startup`` (the environment
variable's startup hook, imported by the shipped .pth file), ``registry`` (the entry in torch's
attention-implementation registry) and ``telemetry`` (the report file).
"""

#: The provider's name in ``torch.nn.attention.list_flash_attention_impls()`` (``registry``; here so
#: that ``activation`` can know its own entry without importing ``registry``, which imports it).
REGISTRY_NAME = "CUDNN_SDPA_PROVIDER"
