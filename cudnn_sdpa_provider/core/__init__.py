"""Layer 1, the core: plain data and pure decisions, no cuDNN and no dispatcher.

Errors, reason slugs and paths (``reasons``), the environment knobs (``env``, the only module that reads
the process environment), graph keys and layouts, the per-call scope, argument checks, the
counters, and the capability rules (``support``: which call is served, and why not).
"""
