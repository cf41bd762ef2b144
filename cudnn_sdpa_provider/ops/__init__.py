"""Layer 3, the ops: the route every call takes, and the ``cudnn_sdpa::*`` custom ops.

``route`` decides once per call signature: served (a cuDNN graph), fallback (with its reason) or
refused (strict mode), and records it. The custom ops, each with a fake kernel, autograd and a CPU
reference kernel: ``dense_varlen`` (dense_fwd/bwd, varlen_fwd/bwd), ``paged_ops``, ``fp8_ops``;
``composite``, ``reference`` and ``fp8_reference`` are the aten-op kernels they fall back to.
"""
