"""The only module that imports ``cudnn``: graph builds, the bounded cache, handles.

A graph is described by a frozen key (``keys``) (every dim, stride, dtype and option that changes the
graph; never a pointer or a value). ``plan(key)`` returns the built graph from a per-thread LRU
cache, building it on a miss. cuDNN execution plans are not guaranteed thread-safe across engines
(PyTorch keeps its MHA graph caches thread-local for the same reason), so each thread has its own
cache and its own cuDNN handle per device; builds therefore never contend (``clear_cache`` reaches
every thread's cache). ``execute`` binds the handle to the caller's current CUDA stream and runs
the plan with fixed tensor uids.

cuDNN's rejections (``cudnnGraphNotSupportedError``, ``ValueError`` on bad attributes, or any
error during validate/build) become ``NotSupportedError("graph_not_supported", <cuDNN message>)``.
A key the known-issues table covers (``support.known_issue``, on the graph's own dims) never
reaches cuDNN: ``NotSupportedError("cudnn_known_issue", <the row>)``, refused the same way.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..core import counters, env
from . import tuning
from ..core.errors import NotSupportedError
from ..core.keys import UID, BwdKey, Desc, Fp8Key, FwdKey, describe, graph_problem, writes
from ..core.support import cudnn_bounds, known_issue

try:  # importing cudnn never needs a GPU; the backend library is dlopen'ed lazily
    import cudnn

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - exercised on machines without the frontend
    cudnn = None  # type: ignore[assignment]
    _IMPORT_ERROR = f"nvidia-cudnn-frontend is not importable: {exc!r}"

log = logging.getLogger("cudnn_sdpa_provider")

__all__ = ["Desc", "FwdKey", "BwdKey", "Fp8Key", "Plan", "UID", "backend_info", "device_facts", "plan", "cached", "execute", "cache_info",
           "clear_cache", "describe", "writes"]


@dataclass
class Plan:
    graph: object
    workspace: int
    name: str
    outputs: frozenset = frozenset()  # the uids of the buffers the graph writes
    tune: bool = False  # built with every plan: the first execute outside a capture chooses one (tuning)
    index: int | None = None  # the plan tuning chose (executed by index), None: the graph's own
    label: str = ""  # describe(key), for telemetry
    default_index: int = 0  # the heuristic's plan (the graph's selected one when built)
    generation: int = 0  # clear_cache's count when its build began (a plan of an older one is never cached)
    zero_workspace: bool = False  # the workspace starts at 0 each call (FP8 graphs: ``plan``)


def backend_info() -> tuple[str | None, int | None, str | None]:
    """(frontend version, cuDNN backend version, why cuDNN is unusable or None)."""
    if cudnn is None:
        return None, None, _IMPORT_ERROR
    frontend = getattr(cudnn, "__version__", None)
    if not torch.backends.cudnn.is_available():
        # Do not let the frontend dlopen a library torch could not load: a partial cuDNN
        # install (a stub libcudnn.so.9 without its sub-libraries) aborts the process on the
        # first backend call.
        return frontend, None, "PyTorch cannot load a cuDNN library on this machine"
    try:
        return frontend, int(cudnn.backend_version()), None
    except Exception as exc:
        return frontend, None, f"the cuDNN backend library cannot be loaded: {exc}"


# --------------------------------------------------------------------------- handles and caches

_tls = threading.local()
_builds_lock = threading.Lock()
_builds = {"built": 0, "rejected": 0}
_generation = 0  # bumped by clear_cache: a thread whose caches are older drops them on its next call


def _state():
    state = getattr(_tls, "state", None)
    if state is None:
        state = _tls.state = {"handles": {}, "streams": {}, "plans": OrderedDict(), "fast": OrderedDict(),
                              "capacity": env.cache_size(), "generation": _generation}
    elif state["generation"] != _generation:
        state["plans"].clear()
        state["fast"].clear()
        state["generation"] = _generation
    return state


def _handle(device: int):
    handles = _state()["handles"]
    h = handles.get(device)
    if h is None:
        with torch.cuda.device(device):
            h = cudnn.create_handle()
        handles[device] = h
    return h


def cache_info() -> dict:
    """This thread's cache size and capacity, and the process-wide build counts."""
    state = _state()
    with _builds_lock:
        counts = dict(_builds)
    return {"size": len(state["plans"]), "capacity": state["capacity"], **counts}


def clear_cache() -> None:
    """Drop the built graphs and fast-path entries of every thread (handles are kept): this thread's
    now, another thread's (autograd's device threads, which run the backwards) on its next call, so
    a thread that makes no more calls keeps its graphs' memory until it does. A graph whose build
    was under way during the clear is used by its call and not cached."""
    global _generation
    with _builds_lock:
        _generation += 1
    _state()


def set_capacity(n: int) -> None:
    """Bound this thread's cache to ``n`` graphs (tests; the default comes from the environment)."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"cache capacity must be a positive int, got {n!r}")
    state = _state()
    state["capacity"] = n
    for cache in (state["plans"], state["fast"]):
        while len(cache) > n:
            cache.popitem(last=False)


def fast_get(signature: tuple):
    """The binding (``binding.Binding``) for a call signature, or None. Bindings hold their built
    graph; the cache is a bounded LRU like the graph cache, so an evicted graph is never kept alive
    by it for long."""
    fast = _state()["fast"]
    found = fast.get(signature)
    if found is not None:
        fast.move_to_end(signature)
    return found


def fast_put(signature: tuple, entry) -> None:
    """Cache a binding, unless its graph was built before a ``clear_cache`` (from any thread)."""
    if getattr(getattr(entry, "plan", None), "generation", _generation) != _generation:
        return
    state = _state()
    fast = state["fast"]
    fast[signature] = entry
    while len(fast) > state["capacity"]:
        fast.popitem(last=False)


def cached(key) -> Plan | None:
    """The built graph for ``key`` if this thread's cache holds one (never builds; a remembered
    rejection is None too)."""
    found = _state()["plans"].get(key)
    return found if isinstance(found, Plan) else None


def plan(key) -> Plan:
    """The built graph for ``key`` (this thread's LRU cache; built on a miss)."""
    state = _state()
    plans = state["plans"]
    found = plans.get(key)
    if found is not None:
        plans.move_to_end(key)
        if isinstance(found, tuple):  # a rejection: a fresh exception each time (a reused one would
            raise NotSupportedError(*found)  # collect every raising call's frames in its traceback)
        return found
    generation = _generation
    started = time.perf_counter()
    try:
        _refuse_known_bad(key)  # before cuDNN sees the graph: some of these crash the process
        built = _build(key, _handle(key.device))
        built.generation = generation
        # FP8 graphs get a zeroed workspace, a precaution: with stale memory in the allocator's
        # small-block pool cuDNN 9.19's padded FP8 backward returned wrong dK/dV on sm_90 where a
        # fresh process (memory at 0) did not, and zeroed amax outputs and a zeroed workspace
        # together did not fully cure it (results/gpu-run65-fp8-diag.jsonl): those backwards run
        # the reference (core.known_issues). Autotune's trial runs (``tuning``) are not zeroed.
        built.zero_workspace = isinstance(key, Fp8Key)
    except NotSupportedError as exc:
        built = (exc.reason, exc.detail)  # remember rejections too: not rebuilt on every call
    counters.note_build(time.perf_counter() - started, rejected=isinstance(built, tuple))
    with _builds_lock:
        _builds["rejected" if isinstance(built, tuple) else "built"] += 1
    if not isinstance(built, tuple):
        counters.note_plan(describe(key), built.name)
    if generation == _generation:  # a clear_cache during the build: this call uses it, nothing keeps it
        plans[key] = built
    while len(plans) > state["capacity"]:
        plans.popitem(last=False)
    if isinstance(built, tuple):
        raise NotSupportedError(*built)
    return built


def device_facts(device: int) -> tuple:
    """(cuDNN backend version, compute capability) of ``device``."""
    return _device_facts(device)


@functools.lru_cache(maxsize=None)
def _device_facts(device: int) -> tuple:
    """(cuDNN backend version, compute capability) of ``device``, for the known-issues check."""
    cc = tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else None
    return backend_info()[1], cc


def _refuse_known_bad(key) -> None:
    """The known-issues table on the graph actually built (a bucketed or repaired graph's dims are
    not its call's), refused like cuDNN's own rejections: ``plan`` remembers it, ``route.call``
    falls back with its ``cudnn_known_issue`` reason."""
    version, cc = _device_facts(key.device)
    found = known_issue(version, cc, graph_problem(key))
    if found is not None:
        log.info("not building %s graph: %s", describe(key), found.message)
        raise NotSupportedError(found.slug, found.message)


#: First frontend whose ``graph.execute`` takes ordered buffers with ``tensor_uids`` (1.28 does not).
ORDERED_SINCE = (1, 31)


def ordered_execute(version: str | None) -> bool:
    """Whether frontend ``version`` takes ordered buffers (``"1.32.0"`` -> True)."""
    try:
        return tuple(int(part) for part in (version or "").split(".")[:2]) >= ORDERED_SINCE
    except ValueError:  # a local or dev build we cannot read: the mapping form works everywhere
        return False


_ORDERED = ordered_execute(getattr(cudnn, "__version__", None))


def execute(p: Plan, uids: tuple, buffers: tuple, device: int, stream: int) -> None:
    """Run ``p`` on ``buffers`` (tensors, in the order of ``uids``) on the given CUDA stream handle.

    The handle (this thread's, per device) is re-bound only when the stream changes (frontend
    1.32's ``set_stream`` skips an unchanged stream itself; 1.28's does not). Frontends 1.31+ take
    the buffers in order with ``tensor_uids``, which skips their mapping normalisation; older ones
    get the mapping. A binding keeps ``uids`` fixed, so order and tensors always correspond."""
    if device is not None and torch.cuda.is_initialized() and torch.cuda.current_device() != device:
        # Python kernels get no device guard from the dispatcher
        with torch.cuda.device(device):
            return execute(p, uids, buffers, device, stream)
    state = _state()
    handle = _handle(device)
    if state["streams"].get(device) != stream:
        cudnn.set_stream(handle=handle, stream=stream)
        state["streams"][device] = stream
    if p.tune and not torch.cuda.is_current_stream_capturing():
        tuning.tune(p, lambda index, ws: p.graph.execute_plan_at_index(buffers, ws, index=index, handle=handle,
                                                                        tensor_uids=uids),
                    [b for u, b in zip(uids, buffers) if u in p.outputs], device)
    workspace = None
    if p.workspace:
        workspace = (torch.zeros if p.zero_workspace else torch.empty)(p.workspace, dtype=torch.uint8,
                                                                       device=torch.device("cuda", device))
    if p.index is not None:
        p.graph.execute_plan_at_index(buffers, workspace, index=p.index, handle=handle, tensor_uids=uids)
    elif _ORDERED:
        p.graph.execute(buffers, workspace, handle=handle, tensor_uids=uids)
    else:
        p.graph.execute(dict(zip(uids, buffers)), workspace, handle=handle)


# --------------------------------------------------------------------------------- graph builds

_IO = {}


def _dt(dtype: torch.dtype):
    if not _IO:
        t = cudnn.data_type
        _IO.update({torch.float16: t.HALF, torch.bfloat16: t.BFLOAT16, torch.float32: t.FLOAT, torch.int32: t.INT32,
                    torch.int64: t.INT64, torch.float8_e4m3fn: t.FP8_E4M3, torch.float8_e5m2: t.FP8_E5M2})
    return _IO[dtype]


def _tensor(g, uid: UID, d: Desc):
    return g.tensor(name=uid.name.lower(), dim=list(d.dims), stride=list(d.strides), data_type=_dt(d.dtype), uid=int(uid))


def _index_tensor(g, uid: UID, n: int):
    return g.tensor(name=uid.name.lower(), dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=int(uid))


def _output(t, uid: UID, d: Desc):
    t.set_output(True).set_uid(int(uid)).set_dim(list(d.dims)).set_stride(list(d.strides)).set_data_type(_dt(d.dtype))
    return t


def _mask_kwargs(g, key) -> dict:
    left, right = cudnn_bounds(key.window)
    kw = {
        "attn_scale": float(key.scale),
        "diagonal_alignment": (
            cudnn.diagonal_alignment.BOTTOM_RIGHT if key.bottom_right else cudnn.diagonal_alignment.TOP_LEFT
        ),
        "diagonal_band_left_bound": left,
        "diagonal_band_right_bound": right,
    }
    batch = key.q.dims[0]
    if key.padded or key.ragged:
        kw["use_padding_mask"] = True
        kw["seq_len_q"] = _index_tensor(g, UID.SEQ_Q, batch)
        kw["seq_len_kv"] = _index_tensor(g, UID.SEQ_KV, batch)
    if key.sinks:
        h = key.q.dims[1]
        kw["sink_token"] = g.tensor(name="sink", dim=[1, h, 1, 1], stride=[h, 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=int(UID.SINK))
    if key.bias is not None:
        kw["bias"] = _tensor(g, UID.BIAS, key.bias)
    if getattr(key, "pages", None) is not None:  # one table for K and V, bound twice
        table, kw["paged_attention_max_seq_len_kv"] = key.pages
        kw["paged_attention_k_table"] = _tensor(g, UID.PAGE_K, table)
        kw["paged_attention_v_table"] = _tensor(g, UID.PAGE_V, table)
    if key.dropout_p > 0.0:
        seed = g.tensor(name="seed", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=int(UID.SEED))
        offset = g.tensor(name="offset", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=int(UID.OFFSET))
        kw["dropout"] = (float(key.dropout_p), seed, offset)
    return kw


def _ragged(g, t, uid: UID, batch: int):
    t.set_ragged_offset(_index_tensor(g, uid, batch + 1))


def _new_graph(key, handle):
    return cudnn.pygraph(io_data_type=_dt(key.q.dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def _build_fwd(key: FwdKey, handle):
    g = _new_graph(key, handle)
    q, k, v = _tensor(g, UID.Q, key.q), _tensor(g, UID.K, key.k), _tensor(g, UID.V, key.v)
    batch = key.q.dims[0]
    if key.ragged:
        _ragged(g, q, UID.RAG_Q, batch)
        _ragged(g, k, UID.RAG_K, batch)
        _ragged(g, v, UID.RAG_V, batch)
    kw = _mask_kwargs(g, key)
    if key.rng_dump:
        b, h, s_q, s_kv = key.q.dims[0], key.q.dims[1], key.q.dims[2], key.k.dims[2]
        kw["rng_dump"] = g.tensor(name="rng_dump", dim=[b, h, s_q, s_kv], stride=[h * s_q * s_kv, s_q * s_kv, s_kv, 1],
                                  data_type=cudnn.data_type.FLOAT, uid=int(UID.RNG_DUMP))
    o, stats = g.sdpa(q, k, v, generate_stats=key.lse is not None, **kw)
    _output(o, UID.O, key.o)
    if key.ragged:
        _ragged(g, o, UID.RAG_O, batch)
    if key.lse is not None:
        _output(stats, UID.LSE, key.lse)
        if key.ragged:
            _ragged(g, stats, UID.RAG_LSE, batch)
    return g


def _build_bwd(key: BwdKey, handle):
    g = _new_graph(key, handle)
    q, k, v = _tensor(g, UID.Q, key.q), _tensor(g, UID.K, key.k), _tensor(g, UID.V, key.v)
    o, do, lse = _tensor(g, UID.O, key.o), _tensor(g, UID.DO, key.do), _tensor(g, UID.LSE, key.lse)
    batch = key.q.dims[0]
    if key.ragged:
        for t, uid in ((q, UID.RAG_Q), (k, UID.RAG_K), (v, UID.RAG_V), (o, UID.RAG_O), (do, UID.RAG_DO)):
            _ragged(g, t, uid, batch)
        if not key.padded_lse:
            _ragged(g, lse, UID.RAG_LSE, batch)
    kw = _mask_kwargs(g, key)
    if key.sinks:
        h = key.q.dims[1]
        kw["dSink_token"] = g.tensor(name="dsink", dim=[1, h, 1, 1], stride=[h, 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=int(UID.DSINK))
    if key.max_total is not None:
        kw["max_total_seq_len_q"], kw["max_total_seq_len_kv"] = key.max_total
    dq, dk, dv = g.sdpa_backward(q, k, v, o, do, lse, use_deterministic_algorithm=bool(key.deterministic), **kw)
    _output(dq, UID.DQ, key.dq)
    _output(dk, UID.DK, key.dk)
    _output(dv, UID.DV, key.dv)
    if key.ragged:
        _ragged(g, dq, UID.RAG_DQ, batch)
        _ragged(g, dk, UID.RAG_DK, batch)
        _ragged(g, dv, UID.RAG_DV, batch)
    return g


def _scalars(g, *uids):
    return [g.tensor(name=u.name.lower(), dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                     uid=int(u)) for u in uids]


def _amax_outputs(tensors, uids):
    for t, uid in zip(tensors, uids):
        _output(t, uid, Desc((1, 1, 1, 1), (1, 1, 1, 1), torch.float32))


def _fp8_mask(g, key: Fp8Key) -> dict:
    kw = {"attn_scale": float(key.scale), "use_causal_mask": bool(key.causal)}
    if key.padded or key.ragged:
        batch = key.q.dims[0]
        kw.update(use_padding_mask=True, seq_len_q=_index_tensor(g, UID.SEQ_Q, batch),
                  seq_len_kv=_index_tensor(g, UID.SEQ_KV, batch))
    return kw


def _build_fp8(key: Fp8Key, handle):
    """``sdpa_fp8`` (forward) or ``sdpa_fp8_backward``: FP8 operands, fp32 scales and amax values."""
    g = _new_graph(key, handle)
    q, k, v = _tensor(g, UID.Q, key.q), _tensor(g, UID.K, key.k), _tensor(g, UID.V, key.v)
    if not key.backward:
        factors = _scalars(g, UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V, UID.DESCALE_S, UID.SCALE_S, UID.SCALE_O)
        batch = key.q.dims[0]
        if key.ragged:  # packed (T, H, D): each sequence at its ragged offset (engine/fp8_packed.py)
            for t, uid in ((q, UID.RAG_Q), (k, UID.RAG_K), (v, UID.RAG_V)):
                _ragged(g, t, uid, batch)
        o, stats, amax_s, amax_o = g.sdpa_fp8(q, k, v, *factors, generate_stats=key.lse is not None,
                                              **_fp8_mask(g, key))
        _output(o, UID.O, key.o)
        if key.ragged:
            _ragged(g, o, UID.RAG_O, batch)
        if key.lse is not None:
            _output(stats, UID.LSE, key.lse)
            if key.ragged:
                _ragged(g, stats, UID.RAG_LSE, batch)
        _amax_outputs((amax_s, amax_o), (UID.AMAX_S, UID.AMAX_O))
        return g
    o, do, lse = _tensor(g, UID.O, key.o), _tensor(g, UID.DO, key.do), _tensor(g, UID.LSE, key.lse)
    factors = _scalars(g, UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V, UID.DESCALE_O, UID.DESCALE_DO, UID.DESCALE_S,
                       UID.DESCALE_DP, UID.SCALE_S, UID.SCALE_DQ, UID.SCALE_DK, UID.SCALE_DV, UID.SCALE_DP)
    dq, dk, dv, *amax = g.sdpa_fp8_backward(q, k, v, o, do, lse, *factors, **_fp8_mask(g, key))[:7]
    for t, uid, d in ((dq, UID.DQ, key.dq), (dk, UID.DK, key.dk), (dv, UID.DV, key.dv)):
        _output(t, uid, d)
    _amax_outputs(amax, (UID.AMAX_DQ, UID.AMAX_DK, UID.AMAX_DV, UID.AMAX_DP))
    return g


def _plan_name(g) -> str:
    try:
        return str(g.get_plan_name_at_index(int(getattr(g, "_plan_index", 0) or 0)))
    except Exception:  # best effort: names are telemetry, not behaviour
        return "unknown"


def _prepare(g, tune: bool) -> bool:
    """Rank the plans (with ``tune``, mode B's too: the plan sweep's candidates) and check support;
    with ``tune``, build every plan (the heuristic's first stays selected) and return True, else
    build the first. Autotune is an extra: whatever the frontend refuses of it, the usual build runs."""
    modes = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
    try:
        g.create_execution_plans(modes[:1] + [cudnn.heur_mode.B] + modes[1:] if tune else modes)
    except Exception as exc:
        if not tune:
            raise
        log.info("autotune: no mode-B plans (%s: %s)", type(exc).__name__, exc)
        g.create_execution_plans(modes)
    g.check_support()
    if tune:
        try:
            g.build_plans(cudnn.build_plan_policy.ALL)
            return True
        except Exception as exc:
            log.info("autotune: cannot build every plan (%s: %s); using the heuristic's", type(exc).__name__, exc)
    g.build_plans()
    return False


def _build(key, handle) -> Plan:
    if cudnn is None:
        raise NotSupportedError("cudnn_unavailable", _IMPORT_ERROR or "cudnn is not importable")
    try:
        with torch.cuda.device(key.device):
            build = _build_fp8 if isinstance(key, Fp8Key) else _build_bwd if isinstance(key, BwdKey) else _build_fwd
            g = build(key, handle)
            g.validate()
            g.build_operation_graph()
            tune = _prepare(g, _ORDERED and env.autotune() and not getattr(key, "deterministic", False))
            workspace = int(g.get_workspace_size())
    except NotSupportedError:
        raise
    except Exception as exc:
        # cudnnGraphNotSupportedError derives from plain Exception, bad attributes raise
        # ValueError: either way cuDNN will not run this graph; the provider falls back.
        message = f"{type(exc).__name__}: {exc}".strip()
        log.info("cuDNN rejected %s graph: %s", describe(key), message)
        raise NotSupportedError("graph_not_supported", message) from None
    name = _plan_name(g)
    log.info("built cuDNN graph, plan %s, workspace %d bytes: %s", name, workspace, describe(key))
    return Plan(graph=g, workspace=workspace, name=name, outputs=writes(key), tune=tune, label=describe(key),
                default_index=int(getattr(g, "_plan_index", 0) or 0))
