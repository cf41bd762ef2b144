"""A stand-in for cuDNN's SDPA graphs on CPU tensors, for the CPU tier.

``install(monkeypatch)`` replaces the graph build with ``FakeGraph``: its ``execute`` reads every
operand exactly as the graph key declares it (dims, strides, ragged offsets in elements, the buffer
order given by the uids), computes attention with ``reference`` in fp64, and writes the outputs
through the declared strides. So the engine's descriptors, repair plans, output layouts, buffer
order and ragged offsets are checked against what they claim, on a machine without a GPU. It knows
nothing of cuDNN's kernels: what only the GPU shows (alignment faults, plan bugs) stays for the GPU
tier. ``FakeGraph.calls`` records what each execute received. FP8 graphs (``Fp8Key``: the dense
forward and backward, and the packed forward with ragged offsets) compute with ``fp8_reference``,
the FP8 reference the CPU kernels run, sequence by sequence for a packed one.
"""

from __future__ import annotations

import dataclasses

import torch

from cudnn_sdpa_provider.engine import folded, graphs, machine
from cudnn_sdpa_provider.ops import fp8_reference, reference
from cudnn_sdpa_provider.core import support
# bound here, not looked up on the module: tests count the engine's calls of these
from cudnn_sdpa_provider.core.rows import dead_rows as _dead_rows, rows_past as _rows_past
from cudnn_sdpa_provider.engine.graphs import UID, BwdKey, Fp8Key

HOPPER = support.Capabilities(cuda=True, compute_capability=(9, 0), cudnn_version=91900, frontend_version="1.32.0",
                              device_name="fake H200")


class FakeGraph:
    builds = 0

    def __init__(self, key):
        self.key = key
        self.calls = []
        FakeGraph.builds += 1

    # ------------------------------------------------------------------------------ reading
    def _dense(self, buf, d):
        return torch.as_strided(buf, d.dims, d.strides, buf.storage_offset())

    def _ragged(self, buf, d, offsets, lengths):
        """Per sequence b: (H, len_b, D) from base + offsets[b] with the declared head/token strides."""
        _, h, _, dd = d.dims
        _, hs, ts, ds = d.strides
        assert offsets.numel() == d.dims[0] + 1 and lengths.numel() == d.dims[0], \
            f"{lengths.numel()} lengths and {offsets.numel()} offsets for a declared batch of {d.dims[0]}"
        out = []
        for off, n in zip(offsets.view(-1).tolist(), lengths.view(-1).tolist()):
            assert 0 <= n <= d.dims[2], f"a length {n} past the declared S_max {d.dims[2]}"
            if n == 0:
                out.append(None)
                continue
            last = buf.storage_offset() + off + (h - 1) * hs + (n - 1) * ts + (dd - 1) * ds
            assert off >= 0 and last < buf.untyped_storage().nbytes() // buf.element_size(), "read outside the buffer"
            out.append(torch.as_strided(buf, (h, n, dd), (hs, ts, ds), buf.storage_offset() + off))
        return out

    # ------------------------------------------------------------------------------ execute
    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        b = dict(zip(tensor_uids, buffers)) if tensor_uids is not None else dict(buffers)
        b = {UID(int(u)): t for u, t in b.items()}
        self.calls.append(b)
        if isinstance(self.key, Fp8Key):
            self._fp8(b)
        elif isinstance(self.key, BwdKey):
            self._backward(b)
        else:
            self._forward(b)

    # ---------------------------------------------------------------------------------- FP8
    def _fp8(self, b):
        k = self.key
        scale_s = float(b[UID.SCALE_S].reshape(-1)[0])
        lens = (b[UID.SEQ_Q].view(-1), b[UID.SEQ_KV].view(-1)) if (k.padded or k.ragged) else (None, None)
        if k.backward:
            return self._fp8_backward(b, lens, scale_s)
        factors = [b[u] for u in (UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V)] + [b[UID.SCALE_O]]
        if k.ragged:
            return self._fp8_forward_ragged(b, lens, scale_s, factors)
        q, kk, v = (self._dense(b[u], d) for u, d in ((UID.Q, k.q), (UID.K, k.k), (UID.V, k.v)))
        out, lse, amax = fp8_reference.forward(q, kk, v, *factors, *lens, k.scale, scale_s, k.causal,
                                               k.lse is not None)
        self._dense(b[UID.O], k.o).copy_(out)
        if k.lse is not None:
            self._dense(b[UID.LSE], k.lse).copy_(lse)
        b[UID.AMAX_S].fill_(amax[0])
        b[UID.AMAX_O].fill_(amax[1])

    def _fp8_forward_ragged(self, b, lens, scale_s, factors):
        """Each sequence read and written at its ragged offset for its own length, nothing else."""
        k, (lq, lk) = self.key, lens
        qs = self._ragged(b[UID.Q], k.q, b[UID.RAG_Q], lq)
        ks = self._ragged(b[UID.K], k.k, b[UID.RAG_K], lk)
        vs = self._ragged(b[UID.V], k.v, b[UID.RAG_V], lk)
        os_ = self._ragged(b[UID.O], k.o, b[UID.RAG_O], lq)
        lses = self._ragged(b[UID.LSE], k.lse, b[UID.RAG_LSE], lq) if k.lse is not None else [None] * len(qs)
        amax = torch.zeros(2)
        for q, kk, v, o, lse in zip(qs, ks, vs, os_, lses):
            if q is None or kk is None:
                continue
            out, l, a = fp8_reference.forward(q[None], kk[None], v[None], *factors, None, None, k.scale, scale_s,
                                              k.causal, lse is not None)
            o.copy_(out[0])
            if lse is not None:
                lse.copy_(l[0])
            amax = torch.maximum(amax, a)
        b[UID.AMAX_S].fill_(amax[0])
        b[UID.AMAX_O].fill_(amax[1])

    def _fp8_backward(self, b, lens, scale_s):
        k = self.key
        q, kk, v, o, do = (self._dense(b[u], d) for u, d in ((UID.Q, k.q), (UID.K, k.k), (UID.V, k.v),
                                                              (UID.O, k.o), (UID.DO, k.do)))
        descales = [b[u] for u in (UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V, UID.DESCALE_O, UID.DESCALE_DO)]
        # the LSE the graph reads must be the forward's on the same operands, row by row (cuDNN's
        # backward uses it; the reference recomputes it): a misplaced row would go unnoticed otherwise
        _, want, _ = fp8_reference.forward(q, kk, v, *descales[:3], torch.ones(1), *lens, k.scale, scale_s, k.causal,
                                           True)
        got = self._dense(b[UID.LSE], k.lse)
        live = torch.isfinite(want)
        if lens[0] is not None:
            live &= torch.arange(q.shape[2]).view(1, 1, -1, 1) < lens[0].view(-1, 1, 1, 1)
        assert torch.allclose(got[live], want[live], rtol=1e-5, atol=1e-5), "the LSE the backward reads is not its forward's"
        scales = torch.cat([b[u].reshape(1) for u in (UID.SCALE_DQ, UID.SCALE_DK, UID.SCALE_DV, UID.SCALE_DP)])
        dq, dk, dv, amax = fp8_reference.backward(do, q, kk, v, o, descales, scales, *lens, k.scale, scale_s,
                                                  k.causal, (torch.float8_e4m3fn,) * 3)
        for uid, d, g in ((UID.DQ, k.dq, dq), (UID.DK, k.dk, dk), (UID.DV, k.dv, dv)):
            self._dense(b[uid], d).copy_(g)
        for uid, a in zip((UID.AMAX_DQ, UID.AMAX_DK, UID.AMAX_DV, UID.AMAX_DP), amax):
            b[uid].fill_(a)

    def _options(self, b):
        k = self.key
        lens = (b[UID.SEQ_Q].view(-1), b[UID.SEQ_KV].view(-1)) if (k.padded or k.ragged) else (None, None)
        sinks = b[UID.SINK].view(-1) if k.sinks else None
        bias = self._dense(b[UID.BIAS], k.bias) if k.bias is not None else None
        return lens, sinks, bias

    def _dropout_operands(self, b) -> bool:
        """With dropout the fake checks the Philox operands' form and computes nothing."""
        if not self.key.dropout_p:
            return False
        assert b[UID.SEED].numel() == 1 and b[UID.OFFSET].numel() == 1, "seed/offset are single elements"
        assert b[UID.SEED].dtype == b[UID.OFFSET].dtype == torch.int64
        return True

    def _forward(self, b):
        k = self.key
        if self._dropout_operands(b):
            return
        (lq, lk), sinks, bias = self._options(b)
        if k.ragged:
            return self._forward_ragged(b, lq, lk, sinks)
        q, kk, v = (self._dense(b[u], d).double() for u, d in ((UID.Q, k.q), (UID.K, k.k), (UID.V, k.v)))
        if getattr(k, "pages", None) is not None:
            kk, v = self._pages(b, kk, v, lk)
        out, lse = reference.dense(q, kk, v, scale=k.scale, window=k.window, bottom_right=k.bottom_right, sinks=sinks,
                                   bias=bias, seq_len_q=lq, seq_len_kv=lk, compute_dtype=torch.float64)
        self._dense(b[UID.O], k.o).copy_(self._unspecified(out, lq, lk, kk.shape[2]))
        if k.lse is not None:
            self._dense(b[UID.LSE], k.lse).copy_(lse)

    def _pages(self, b, k_cache, v_cache, lk):
        """Dense (B, H, M x block, D) K/V gathered through the table as cuDNN reads it: only the blocks
        each sequence's keys use, every one of them inside the cache (else the fake fails the call)."""
        desc, capacity = self.key.pages
        assert b[UID.PAGE_K] is b[UID.PAGE_V], "one table for K and V"
        table = self._dense(b[UID.PAGE_K], desc).reshape(desc.dims[0], desc.dims[2])
        block = k_cache.shape[2]
        assert table.shape[1] * block == capacity, "max_seq_len_kv is the table's capacity"
        rows = []
        for entries, n in zip(table.tolist(), lk.tolist()):
            used = entries[: -(-n // block)]
            assert all(0 <= e < k_cache.shape[0] for e in used), f"a used table entry outside the cache: {used}"
            rows.append([e if 0 <= e < k_cache.shape[0] else 0 for e in entries])  # unused entries: never read
        idx = torch.tensor(rows, dtype=torch.long)

        def gather(cache):
            n_b, m = idx.shape
            return cache[idx].permute(0, 2, 1, 3, 4).reshape(n_b, cache.shape[1], m * block, cache.shape[3])

        return gather(k_cache), gather(v_cache)

    def _forward_ragged(self, b, lq, lk, sinks):
        k = self.key
        qs = self._ragged(b[UID.Q], k.q, b[UID.RAG_Q], lq)
        ks = self._ragged(b[UID.K], k.k, b[UID.RAG_K], lk)
        vs = self._ragged(b[UID.V], k.v, b[UID.RAG_V], lk)
        os_ = self._ragged(b[UID.O], k.o, b[UID.RAG_O], lq)
        lses = self._ragged(b[UID.LSE], k.lse, b[UID.RAG_LSE], lq) if k.lse is not None else [None] * len(qs)
        for q, kk, v, o, lse in zip(qs, ks, vs, os_, lses):
            if q is None:
                continue
            if kk is None:  # no keys: cuDNN < 9.25 writes NaN rows (the engine zeroes them)
                o.fill_(float("nan"))
                continue
            out, l = reference.dense(q[None].double(), kk[None].double(), v[None].double(), scale=k.scale,
                                     window=k.window, bottom_right=k.bottom_right, sinks=sinks,
                                     compute_dtype=torch.float64)
            o.copy_(out[0])
            if lse is not None:
                lse.copy_(l[0])

    def _backward(self, b):
        k = self.key
        if self._dropout_operands(b):
            return
        (lq, lk), sinks, bias = self._options(b)
        if k.ragged:
            return self._backward_ragged(b, lq, lk, sinks)
        q, kk, v, do = (self._dense(b[u], d).double() for u, d in ((UID.Q, k.q), (UID.K, k.k), (UID.V, k.v),
                                                                   (UID.DO, k.do)))
        self._dense(b[UID.LSE], k.lse)  # declared readable
        dq, dk, dv, _ = reference.dense_backward(do, q, kk, v, scale=k.scale, window=k.window,
                                                 bottom_right=k.bottom_right, sinks=sinks, bias=bias, seq_len_q=lq,
                                                 seq_len_kv=lk, compute_dtype=torch.float64)
        if lq is not None:  # keys past a sequence's length: unspecified too (the engine zeroes them)
            past = _rows_past(lk, kk.shape[2])
            dk, dv = dk.masked_fill(past, float("nan")), dv.masked_fill(past, float("nan"))
        dq = self._unspecified(dq, lq, lk, kk.shape[2])
        for uid, d, g in ((UID.DQ, k.dq, dq), (UID.DK, k.dk, dk), (UID.DV, k.dv, dv)):
            self._dense(b[uid], d).copy_(g)

    def _unspecified(self, rows_of_q, lq, lk, s_kv: int):
        """A padded call's query rows that are 0 by definition made NaN: cuDNN leaves them
        unspecified (NaN before 9.25), and the engine, not cuDNN, makes them 0."""
        if lq is None:
            return rows_of_q
        dead = _dead_rows(rows_of_q.shape[2], s_kv, self.key.window, self.key.bottom_right, lq, lk)
        return rows_of_q.masked_fill(dead, float("nan"))

    def _accumulator_bound(self, b, lq, lk):
        """With ``max_total_seq_len_q/kv`` cuDNN sizes its fp32 dQ accumulator (and GQA's full-head
        dK/dV) for that many tokens and indexes it by the dQ/dK ragged offsets: every token a call
        writes must lie below the bound (cudnn-frontend, ``CompositeSDPABackwardNode``, "sized THD")."""
        if self.key.max_total is None:
            return
        for side, desc, rag, lens, bound in (("q", self.key.dq, UID.RAG_DQ, lq, self.key.max_total[0]),
                                             ("kv", self.key.dk, UID.RAG_DK, lk, self.key.max_total[1])):
            token = desc.strides[2]  # the declared token stride: offsets are counted in elements
            ends = [off // token + n for off, n in zip(b[rag].view(-1).tolist(), lens.view(-1).tolist()) if n]
            assert max(ends, default=0) <= bound, f"{side}: a token at {max(ends)} past the accumulator bound {bound}"

    def _backward_ragged(self, b, lq, lk, sinks):
        k = self.key
        self._accumulator_bound(b, lq, lk)
        read = lambda uid, d, rag, n: self._ragged(b[uid], d, b[rag], n)  # noqa: E731
        qs, dos, dqs = read(UID.Q, k.q, UID.RAG_Q, lq), read(UID.DO, k.do, UID.RAG_DO, lq), read(UID.DQ, k.dq, UID.RAG_DQ, lq)
        ks, vs = read(UID.K, k.k, UID.RAG_K, lk), read(UID.V, k.v, UID.RAG_V, lk)
        dks, dvs = read(UID.DK, k.dk, UID.RAG_DK, lk), read(UID.DV, k.dv, UID.RAG_DV, lk)
        if k.padded_lse:  # (B, H, S_max, 1) as declared; each sequence's first len_q positions are read
            assert UID.RAG_LSE not in b, "a padded LSE has no ragged offsets"
            padded = self._dense(b[UID.LSE], k.lse)
            lses = [padded[i, :, : q.shape[1]] if q is not None else None for i, q in enumerate(qs)]
        else:
            lses = self._ragged(b[UID.LSE], k.lse, b[UID.RAG_LSE], lq)
        for q, kk, v, do, dq, dk, dv, lse in zip(qs, ks, vs, dos, dqs, dks, dvs, lses):
            if q is None or kk is None:
                continue
            # the LSE the graph reads must be this sequence's forward's, position by position
            _, want = reference.dense(q[None].double(), kk[None].double(), v[None].double(), scale=k.scale,
                                      window=k.window, bottom_right=k.bottom_right, sinks=sinks,
                                      compute_dtype=torch.float64)
            got = lse[..., 0].double()
            assert torch.allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5), \
                "the LSE a sequence's backward reads is not its forward's"
            g = reference.dense_backward(do[None].double(), q[None].double(), kk[None].double(), v[None].double(),
                                         scale=k.scale, window=k.window, bottom_right=k.bottom_right, sinks=sinks,
                                         compute_dtype=torch.float64)
            dq.copy_(g[0][0])
            dk.copy_(g[1][0])
            dv.copy_(g[2][0])


def install(monkeypatch, caps: support.Capabilities = HOPPER) -> list:
    """Route graph builds and executes to ``FakeGraph`` on CPU tensors; returns the list of graphs built."""
    built = []

    def build(key, handle):
        g = FakeGraph(key)
        built.append(g)
        return graphs.Plan(graph=g, workspace=0, name="fake")

    monkeypatch.setattr(graphs, "_build", build)
    monkeypatch.setattr(graphs, "_handle", lambda device: "fake-handle")
    monkeypatch.setattr(graphs, "_ORDERED", True)
    monkeypatch.setattr(graphs, "cudnn", type("FakeCudnn", (), {"set_stream": staticmethod(lambda handle, stream: None)}))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(machine, "capabilities", lambda device_index=None: caps)
    monkeypatch.setattr(folded, "_FAKE_DEVICES", {"cpu"})  # the folded graphs run on the fake's CPU tensors
    monkeypatch.setattr(graphs, "_device_facts", lambda device: (caps.cudnn_version, caps.compute_capability))
    graphs.clear_cache()
    return built


def with_caps(**changes) -> support.Capabilities:
    return dataclasses.replace(HOPPER, **changes)
