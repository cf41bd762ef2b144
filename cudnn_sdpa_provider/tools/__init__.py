"""Layer 7, the tools: the ``cudnn-sdpa`` command (``cli``, the only module that prints), and what
it runs: ``doctor``, ``demo``, ``bench`` and ``docgen`` (the generated docs pages)."""
