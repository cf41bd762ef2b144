"""Layer 2, the engine: the cuDNN graphs. ``graphs`` is the only module that imports ``cudnn``.

``graphs`` (build, plan choice, per-thread bounded cache), ``tuning`` (plan autotuning),
``binding`` (tensors to graph operands), one module per graph family (``dense``, ``packed``,
``paged``, ``fp8_cudnn``), and ``machine`` (the running machine's capabilities).
"""
