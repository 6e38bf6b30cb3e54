"""Masked-position-only LM loss: the LM head (``hidden @ weight.T + bias``) and softmax cross-entropy
evaluated only at positions whose target is not ``ignore_index``, fused so that no full logits tensor
exists. With every target valid it is the causal-LM loss (see :func:`shift_labels`).

Layers: input checks and the public function here; the torch custom ops
``pykernels::masked_lm_loss_fwd`` / ``pykernels::masked_lm_loss_bwd`` (fake impls, autograd) choose a
backend at run time; the Triton kernels live in ``pykernels._kernels.masked_lm_loss``.

The ops work per position: the forward returns the per-position loss (fp32, 0 at ignored positions)
and the lse it saves for the backward; the reduction (sum, mean over the valid count or ``num_valid``)
is plain torch on an (N,) vector, so every reduction shares one backward that takes a per-position
upstream gradient.

The ``cuda`` backend is the CUDA C++ op ``torch.ops.pykernels_cuda.masked_lm_loss`` (``csrc/masked_lm_loss.cu``:
cuBLAS GEMMs over the compacted rows, an fp32 logits chunk at a time, and its autograd in C++), taken when named
(``backend="cuda"``) for plain eager calls; ``auto`` keeps the Triton kernels, which are faster on the GPU.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Optional

import torch
from torch import Tensor

from ._backend import CUDA_TRACED, select, use_cuda_op, warn_slow_once
from ._op import _plain_eager, custom_op
from ._checks import check_nonneg_float, check_prob, check_same, check_tensor
from ._kernels._tuning import capturing, graph_if_support

_REDUCTIONS = ("mean", "sum", "none")
_REDUCTION_CODES = {"none": 0, "sum": 1, "mean": 2}  # the C++ op's (csrc/masked_lm_loss.cu)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def shift_labels(labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Causal-LM targets: ``labels`` shifted left by one along the last dim, ``ignore_index`` appended.

    ``labels`` (..., S) integer -> (..., S) of the same dtype, where ``out[..., i] = labels[..., i + 1]``
    and ``out[..., S - 1] = ignore_index``. Position i's hidden state then predicts token i + 1, so

    >>> loss = pykernels.masked_lm_loss(hidden, wte, pykernels.shift_labels(input_ids), dense=True)

    equals ``F.cross_entropy((hidden @ wte.T)[..., :-1, :].flatten(0, -2), input_ids[..., 1:].flatten())``.
    """
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype, got {labels.dtype}")
    if labels.dim() < 1:
        raise ValueError(f"labels must have at least 1 dim, got shape {tuple(labels.shape)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def masked_lm_loss_reference(hidden: Tensor, weight: Tensor, target: Tensor, *, bias: Tensor | None = None,
                             ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                             num_valid=None, upcast: bool = False, z_loss: float = 0.0) -> Tensor:
    """Eager truth: full logits + ``F.cross_entropy`` (+ ``z_loss * logsumexp**2`` at the valid positions). Same
    arguments as :func:`masked_lm_loss`;
    ``upcast=True`` computes in fp32 (fp64 inputs stay fp64). Returns the loss in the compute dtype.
    Raises ValueError for a target outside [0, V) that is not ``ignore_index`` (this check syncs)."""
    dtype = hidden.dtype
    if upcast and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    h = hidden.to(dtype)
    w = weight.to(dtype)
    v = weight.shape[0]
    bad = (target != ignore_index) & ((target < 0) | (target >= v))
    if bool(bad.any()):
        raise ValueError(f"target has values outside [0, {v}) that are not ignore_index={ignore_index}")
    logits = h.reshape(-1, h.shape[-1]) @ w.t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    t = target.reshape(-1).long()
    loss = torch.nn.functional.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none",
                                             label_smoothing=label_smoothing)
    # cross_entropy leaves ignored positions at 0 (also with smoothing): the per-position loss.
    if z_loss:
        lse = torch.logsumexp(logits.to(loss.dtype), dim=-1)
        loss = loss + torch.where(t != ignore_index, z_loss * lse * lse, 0.0)
    return _reduce(loss.reshape(target.shape), target, ignore_index, reduction, num_valid)


def _denominator(count: Tensor, num_valid, total: Tensor):
    """What a mean divides by (``_reduce`` and the eager lane: the same expression, so the same bits): the
    device count clamped to 1 (an all-ignored call divides 0 by 1, never 0 by 0), or ``num_valid``."""
    if num_valid is None:
        return count.reshape(()).clamp(min=1).to(total.dtype)
    if isinstance(num_valid, Tensor):
        return num_valid.to(device=total.device, dtype=total.dtype)
    return float(num_valid)


def _reduce(loss: Tensor, target: Tensor, ignore_index: int, reduction: str, num_valid,
            count: Optional[Tensor] = None) -> Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    if num_valid is None and count is None:
        count = (target != ignore_index).sum()  # the device count of valid targets (the op's own when given)
    denom = _denominator(count, num_valid, total)
    return total / denom


# ---- custom ops -------------------------------------------------------------------------------------

def compact_rows(target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """The valid positions, compacted on the device without a host sync.

    ``target`` (N,) integer. Returns ``rows`` (N,) int32 whose first ``count`` entries are the positions
    with ``target != ignore_index`` in increasing order (the rest are 0, a valid position to read), and
    ``count`` (1,) int32 (the last entry of the inclusive prefix sum): the kernels read it from device
    memory, so the number of valid rows never reaches the host."""
    n = target.numel()
    valid = target != ignore_index
    csum = torch.cumsum(valid, 0, dtype=torch.int32)
    slot = torch.where(valid, csum - 1, n)  # invalid rows go to a dump slot past the end
    buf = torch.zeros(n + 1, dtype=torch.int32, device=target.device)
    buf.scatter_(0, slot.long(), torch.arange(n, dtype=torch.int32, device=target.device))
    count = csum[-1:].clone() if n else torch.zeros(1, dtype=torch.int32, device=target.device)
    return buf[:n], count


class _CountCopies:
    """Host copies of the forward's valid-row counts, for the backward (the sized path).

    The forward starts a non-blocking copy of its device ``count`` into pinned host memory and records an
    event right after it, before its own kernels. The backward waits on that event only: by then the GPU
    has usually long passed the compaction (the forward's first step) while the forward's kernels are
    still queued behind it, so the wait neither drains the GPU's queue nor leaves it idle.

    Entries are keyed by the device addresses of the forward's ``count``, ``rows`` and ``lse`` outputs,
    which the backward receives (saved tensors are the same storage, not the same Python objects). While
    they are alive no other tensor can hold those addresses; every forward overwrites the entry at its
    own addresses, graph-safe or not, so an entry of a freed forward is never read for a new one. Without
    an entry (graph-safe call, CUDA-graph capture, tracing) the backward takes one that needs no count: the
    graph-safe path, or under capture the one ``_ValidSeen`` picks."""

    _LIMIT = 256  # entries of forwards whose backward never ran (evaluation) drop out beyond this

    def __init__(self):
        self._entries: dict[tuple, tuple] = {}
        self._rings: dict[torch.device, list] = {}  # device -> [pinned int32 slots, events, owner keys, next]
        self._lock = threading.Lock()  # forwards (caller's thread) and backwards (autograd's) both use it

    @staticmethod
    def _key(count: Tensor, rows: Tensor, lse: Tensor) -> tuple:
        return (count.device, count.data_ptr(), rows.data_ptr(), lse.data_ptr())

    def start(self, count: Tensor) -> tuple:
        """Begin the host copy of ``count`` (no wait): returns (host tensor, event or None).

        The pinned slots and their events are a ring per device (``_LIMIT`` of them, allocated once: a
        pinned allocation, a copy and a new event were ~130 us of host time a forward on a slow host).
        A slot is reused ``_LIMIT`` forwards later; the entry still pointing at it, if any (a forward
        whose backward never ran), is dropped first, so a reused slot is never read for an old forward."""
        if not count.is_cuda:
            return count.clone(), None
        with self._lock:
            ring = self._rings.get(count.device)
            if ring is None:
                host = torch.empty(self._LIMIT, dtype=torch.int32, pin_memory=True)
                ring = self._rings[count.device] = [host, [None] * self._LIMIT, [None] * self._LIMIT, 0]
            host, events, owners, i = ring
            ring[3] = (i + 1) % self._LIMIT
            owner = owners[i]
            if owner is not None:  # drop the entry still reading this slot (not a newer one at its key)
                entry = self._entries.get(owner)
                if entry is not None and len(entry) > 2 and entry[2] == (count.device, i):
                    del self._entries[owner]
                owners[i] = None
            if events[i] is None:
                events[i] = torch.cuda.Event()
            slot, event = host[i:i + 1], events[i]
        slot.copy_(count, non_blocking=True)
        event.record(torch.cuda.current_stream(count.device))  # the copy's stream (count's device)
        return slot, event, (count.device, i)

    def put(self, count: Tensor, rows: Tensor, lse: Tensor, copy: Optional[tuple]) -> None:
        """Record this forward's copy, or (``copy`` None) drop any entry left at its addresses."""
        key = self._key(count, rows, lse)
        with self._lock:
            self._entries.pop(key, None)
            if copy is None:
                return
            if len(self._entries) >= self._LIMIT:
                self._entries.pop(next(iter(self._entries)))
            if len(copy) > 2:  # a ring slot: remember which entry holds it
                dev, i = copy[2]
                self._rings[dev][2][i] = key
            self._entries[key] = copy

    def get(self, count: Tensor, rows: Tensor, lse: Tensor) -> Optional[int]:
        """The host value of ``count`` if its forward copied it, else None. Entries stay (a retained
        graph's second backward finds them too) until a forward reuses the addresses or the limit."""
        with self._lock:
            entry = self._entries.get(self._key(count, rows, lse))
        if entry is None:
            return None
        host, event = entry[:2]
        if event is not None:
            event.synchronize()
        return int(host[0])


_COUNTS = _CountCopies()


class _ValidSeen:
    """The valid fraction M / N that eager backwards of N positions last saw on a device, for the backward of a call
    captured in a CUDA graph, which cannot read its count on the host. From that fraction ``bound`` gives a capacity:
    M plus eight binomial standard deviations (a token masked independently with probability M / N exceeds it about
    once in 10^15 batches), rounded up to 64 rows. The captured backward is then

    * the dense one (what ``dense=True`` runs) where that capacity is at least ``DENSE_FROM`` of N (a causal LM's
      warm-up: every position a row, no gather);
    * else the bounded one (``masked_lm_loss_bwd_bounded``): the capacity backward (``max_valid``'s cuBLAS path)
      for up to ``bound`` rows, and the graph-safe kernels for any rows past it in a few row blocks, each an IF
      node of the captured graph run only where a row reaches it (usually none);
    * without a hint (no eager call of that N), graph-safe, as is a call that names ``graph_safe=True``.

    All three are exact for any count at replay (the hint only picks the faster). H200, replayed from a CUDA graph:
    GPT-2, every row valid, dense 4.07 against graph-safe 11.92 ms (run387); BERT-base at 15%, bounded 0.978 ms against
    graph-safe 2.17 and ``max_valid``'s 0.905 for a capacity of 20% of N (run390); 0.902 against 2.127 since the
    overflow pass's programs walk row blocks by a stride (run393: the capacity pass alone 0.844, so ~0.06 ms of
    launches with no row past the bound, and 169 MiB above the inputs); 0.839 at 97.6 MiB since the overflow rows
    are blocks in IF nodes (run402: the capacity pass alone 0.844 in that call; 1.649 ms where 206 rows are past
    the bound, 1.054 since the overflow's dhidden programs split their columns (run406); 1.032 with the IF nodes off,
    where the CUDA extension is not built). The eager warm-up that capture needs anyway
    (``torch.cuda.graph``, ``torch.compile``'s CUDA graphs) leaves the hint."""

    DENSE_FROM = 0.9
    ALIGN = 64
    _LIMIT = 64

    def __init__(self):
        self._seen: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def note(self, device: torch.device, n: int, m: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self._seen.pop((device, n), None)
            if len(self._seen) >= self._LIMIT:
                self._seen.pop(next(iter(self._seen)))
            self._seen[(device, n)] = m / n

    def bound(self, device: torch.device, n: int) -> Optional[int]:
        """The capacity for a captured backward of ``n`` positions (at most n), or None without a hint."""
        with self._lock:
            frac = self._seen.get((device, n))
        if frac is None:
            return None
        mean = n * frac
        cap = mean + 8.0 * math.sqrt(mean * (1.0 - frac)) + 1.0
        return min(n, -(-math.ceil(cap) // self.ALIGN) * self.ALIGN)


def _warn_without_graph_if() -> None:
    """The bounded backward's overflow blocks are IF nodes of the captured graph only where the CUDA extension is
    built; without it they run at every replay: exact, but slower. Say so once."""
    fns, why = graph_if_support()
    if fns is None:
        warn_slow_once("masked_lm_loss",
                       "the backward captured in this CUDA graph launches its overflow-row blocks at every replay "
                       f"instead of in IF nodes ({why}); build the extension (pip install -e . with the CUDA toolkit "
                       "and a visible GPU, or FORCE_CUDA=1) for the faster replay (H200, BERT-base MLM replayed: "
                       "1.032 ms without it in run402, 0.825 with it in run406)")


_VALID_SEEN = _ValidSeen()


def _support(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> dict:
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        reason = f"mixed dtypes (hidden {hidden.dtype}, weight {weight.dtype})"
        return {"triton": reason, "cuda": reason}
    return {"triton": None, "cuda": CUDA_TRACED}


def _cuda_cover(h2: Tensor, weight: Tensor, t1: Tensor, bias: Optional[Tensor], graph_safe: bool, dense: bool,
                max_valid: int, num_valid, z_loss: float = 0.0) -> Optional[str]:
    """None when the CUDA C++ op ``pykernels_cuda::masked_lm_loss`` covers the call, else why not."""
    if z_loss:
        return "z_loss (the CUDA C++ op has no z-loss term; the Triton path and the reference have)"
    if h2.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {h2.dtype} (the CUDA backend takes float16, bfloat16 and float32)"
    if h2.shape[0] >= 2**31 or weight.shape[0] >= 2**31:
        return "N and V must be below 2^31"
    if graph_safe or dense or max_valid or capturing(h2.device):
        return ("the cuda backend waits for the valid count (one host sync in its forward): graph_safe, dense, "
                "max_valid and CUDA-graph capture are the Triton path's")
    if not _plain_eager((h2, weight, t1, bias, num_valid if isinstance(num_valid, Tensor) else None)):
        return "under torch.compile and dispatch modes the op is the Triton custom op (pykernels::masked_lm_loss_fwd)"
    return None


def _use_cuda(backend: Optional[str], h2: Tensor, weight: Tensor, t1: Tensor, bias: Optional[Tensor],
              graph_safe: bool, dense: bool, max_valid: int, num_valid, z_loss: float = 0.0) -> bool:
    """Whether this call runs the CUDA C++ op: only when named (``_backend.use_cuda_op`` with ``auto=False``: the
    Triton path's fused logit tiles are faster on the GPU than cuBLAS with an fp32 logits chunk)."""
    return use_cuda_op("masked_lm_loss", backend, h2.device,
                       lambda: _cuda_cover(h2, weight, t1, bias, graph_safe, dense, max_valid, num_valid, z_loss),
                       auto=False)


def _reference_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss=0.0):
    v = weight.shape[0]
    logits = (hidden @ weight.t()).float()
    if bias is not None:
        logits = logits + bias.float()
    valid = target != ignore_index
    lse = torch.where(valid, torch.logsumexp(logits, dim=-1), 0.0)
    bad = valid & ((target < 0) | (target >= v))
    if bool(bad.any()):
        raise ValueError(f"target has values outside [0, {v}) that are not ignore_index={ignore_index}")
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none",
                                             label_smoothing=label_smoothing)
    if z_loss:
        loss = loss + z_loss * lse * lse  # (lse is 0 at ignored positions)
    return loss, lse


def _reference_bwd(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss):
    """The gradients of :func:`_reference_fwd`'s per-position loss for the upstream ``grad_loss``, written out (the
    backward op's body runs below autograd, and under torch.compile's backward graph an ``autograd.grad`` there has
    no graph to differentiate): dlogits = g ((1 + 2 z lse) softmax - (1 - eps) onehot - eps / V) in fp32 at the
    valid rows, 0 elsewhere, then in the inputs' dtype through the matmul's transposes, as autograd would take the
    fp32 logits' gradient back through ``.float()``. Returns (dhidden, dweight, dbias or None)."""
    v = weight.shape[0]
    logits = (hidden @ weight.t()).float()
    if bias is not None:
        logits = logits + bias.float()
    valid = target != ignore_index
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - lse)
    if z_loss:
        p = p * (1.0 + 2.0 * z_loss * lse)
    onehot = torch.nn.functional.one_hot(torch.where(valid, target, 0), v).to(p.dtype)
    g = torch.where(valid, grad_loss.float(), 0.0)
    d = (p - (1.0 - label_smoothing) * onehot - label_smoothing / v) * g[:, None]
    dl = d.to(hidden.dtype)
    return dl @ weight, dl.t() @ hidden, d.sum(0).to(bias.dtype) if bias is not None else None


def _z_loss_lse(lse: Tensor, z_loss: float) -> Tensor:
    """The lse the backward kernels take for ``z_loss``: the z-loss term ``z lse**2`` adds ``2 z lse softmax`` to a
    row's dlogits, i.e. scales its softmax by ``c = 1 + 2 z lse``, and ``exp(x - (lse - log c)) = c softmax``: the
    kernels (every path: dense, sized, bounded, graph-safe) run unchanged on ``lse - log1p(2 z lse)``. Exact for
    ``c > 0``; ``c = 0`` gives +inf (a softmax of 0, right); ``c < 0`` (lse below ``-1 / (2 z)``: every logit of the
    row below -5000 at z = 1e-4) gives NaN gradients at that row, never a silently wrong one. Ignored positions
    (lse 0) keep 0."""
    return lse - torch.log1p((2.0 * z_loss) * lse) if z_loss else lse


@custom_op("pykernels::masked_lm_loss_fwd", mutates_args=())
def _fwd(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
         label_smoothing: float, graph_safe: bool, dense: bool, backend: str, max_valid: int, z_loss: float = 0.0
         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # hidden (N, H), weight (V, H), target (N,) int64, bias (V,) or None -> loss (N,) fp32, lse (N,) fp32,
    # rows (N,) int32, count (1,) int32 (the compaction, computed once and saved for the backward)
    impl = select("masked_lm_loss", backend or None, hidden.device, _support(hidden, weight, bias))
    if impl == "triton":
        from ._kernels import masked_lm_loss as k
        # one launch (compaction + zeroed outputs) instead of compact_rows' seven, up to 65536 positions
        compacted = k.compact(target, ignore_index)
        if compacted is not None:
            rows, count, loss, lse = compacted
        else:
            rows, count = compact_rows(target, ignore_index)
            loss = lse = None
        # no wait here; the dense backward needs no count on the host at all
        copy = None if graph_safe or dense or max_valid or capturing(hidden.device) else _COUNTS.start(count)
        loss, lse = k.masked_lm_loss_fwd(hidden, weight, target, bias, rows, count,
                                         label_smoothing=label_smoothing, loss=loss, lse=lse)
        if z_loss:
            loss.addcmul_(lse, lse, value=z_loss)  # (lse is 0 at ignored positions: their loss stays 0)
    else:
        rows, count = compact_rows(target, ignore_index)
        copy = None
        loss, lse = _reference_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss)
    _COUNTS.put(count, rows, lse, copy)
    return loss, lse, rows, count


@_fwd.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, graph_safe, dense, backend, max_valid,
      z_loss=0.0):
    n = hidden.shape[0]
    return (hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32),
            hidden.new_empty(n, dtype=torch.int32), hidden.new_empty(1, dtype=torch.int32))


@custom_op("pykernels::masked_lm_loss_bwd", mutates_args=())
def _bwd(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
         lse: Tensor, rows: Tensor, count: Tensor, ignore_index: int, label_smoothing: float,
         need_dhidden: bool, need_dweight: bool, dense: bool, backend: str, max_valid: int, graph_safe: bool,
         z_loss: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    # -> dhidden (N, H), dweight (V, H), dbias (V,); an empty (0,) tensor for each gradient not needed
    # (need_dweight covers weight and bias) and for dbias when bias is None
    impl = select("masked_lm_loss", backend or None, hidden.device, _support(hidden, weight, bias))
    if impl == "triton":
        from ._kernels import masked_lm_loss as k
        captured = capturing(hidden.device)
        m = None if dense or max_valid or captured else _COUNTS.get(count, rows, lse)
        bound = None
        if m is not None:
            _VALID_SEEN.note(hidden.device, hidden.shape[0], m)
        elif captured and not (dense or max_valid or graph_safe):
            bound = _VALID_SEEN.bound(hidden.device, hidden.shape[0])  # (see _ValidSeen)
            if bound is not None and bound >= _VALID_SEEN.DENSE_FROM * hidden.shape[0]:
                dense, bound = True, None
        lse = _z_loss_lse(lse, z_loss)  # (after _COUNTS.get: its entries are keyed by the forward's lse)
        if dense or max_valid >= hidden.shape[0] > 0:  # (a bound of every position: the dense backward,
            # which needs no row gather)
            dh, dw, db = k.masked_lm_loss_bwd_dense(
                grad_loss, hidden, weight, target, bias, lse, ignore_index=ignore_index,
                label_smoothing=label_smoothing, compute_dhidden=need_dhidden, compute_dweight=need_dweight)
        elif max_valid:  # an upper bound of the count on the host: sized for it, no wait, capturable
            dh, dw, db = k.masked_lm_loss_bwd_sized(
                grad_loss, hidden, weight, target, bias, lse, rows, count, min(max_valid, hidden.shape[0]),
                label_smoothing=label_smoothing, compute_dhidden=need_dhidden, compute_dweight=need_dweight,
                ignore_index=ignore_index, capacity=True)
        elif bound is not None:
            _warn_without_graph_if()
            dh, dw, db = k.masked_lm_loss_bwd_bounded(
                grad_loss, hidden, weight, target, bias, lse, rows, count, bound, label_smoothing=label_smoothing,
                compute_dhidden=need_dhidden, compute_dweight=need_dweight, ignore_index=ignore_index)
        elif m is not None:
            dh, dw, db = k.masked_lm_loss_bwd_sized(
                grad_loss, hidden, weight, target, bias, lse, rows, count, m, label_smoothing=label_smoothing,
                compute_dhidden=need_dhidden, compute_dweight=need_dweight, ignore_index=ignore_index)
        else:
            dh, dw, db = k.masked_lm_loss_bwd(grad_loss, hidden, weight, target, bias, lse, rows, count,
                                              label_smoothing=label_smoothing, compute_dhidden=need_dhidden,
                                              compute_dweight=need_dweight)
    else:
        dh, dw, db = _reference_bwd(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss)
        dh = dh.contiguous() if need_dhidden else None
        dw = dw.contiguous() if need_dweight else None
        db = db if need_dweight else None
    empty0 = hidden.new_empty(0)
    return (empty0 if dh is None else dh, empty0.clone() if dw is None else dw,
            empty0.clone() if db is None else db)


@_bwd.register_fake
def _(grad_loss, hidden, weight, target, bias, lse, rows, count, ignore_index, label_smoothing,
      need_dhidden, need_dweight, dense, backend, max_valid, graph_safe, z_loss=0.0):
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dhidden else hidden.new_empty(0)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dweight else hidden.new_empty(0)
    db = (torch.empty_like(bias, memory_format=torch.contiguous_format) if need_dweight and bias is not None
          else hidden.new_empty(0))
    return dh, dw, db


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ignore_index, label_smoothing, graph_safe, dense, backend, max_valid, z_loss = inputs
    _, lse, rows, count = output
    ctx.save_for_backward(hidden, weight, target, bias, lse, rows, count)
    ctx.ignore_index = ignore_index
    ctx.label_smoothing = label_smoothing
    ctx.backend = backend
    ctx.dense = dense
    ctx.max_valid = max_valid
    ctx.graph_safe = graph_safe
    ctx.z_loss = z_loss
    ctx.mark_non_differentiable(lse, rows, count)


def _backward(ctx, grad_loss, grad_lse, grad_rows, grad_count):
    hidden, weight, target, bias, lse, rows, count = ctx.saved_tensors
    need_dh = ctx.needs_input_grad[0]
    need_dw = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[3])
    dh, dw, db = _bwd(grad_loss, hidden, weight, target, bias, lse, rows, count, ctx.ignore_index,
                      ctx.label_smoothing, need_dh, need_dw, ctx.dense, ctx.backend, ctx.max_valid, ctx.graph_safe,
                      ctx.z_loss)
    return (dh if need_dh else None, dw if ctx.needs_input_grad[1] else None, None,
            db if bias is not None and ctx.needs_input_grad[3] else None) + (None,) * 7


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- eager path: the op and the reduction in one autograd node ----------------------------------------

_LANE_ON = os.environ.get("PYKERNELS_EAGER_LANE", "1") not in ("", "0")  # read once (tests flip the attribute)


class _EagerLoss(torch.autograd.Function):
    """Plain eager calls: the op's forward body, then the reduction, recorded as one autograd node
    instead of four (the op's, the reshape's, the sum's and the division's); its backward forms the
    per-position upstream gradient as those nodes would (``grad / denominator``, expanded) and calls
    the backward op. The same functions in the same order as the registered op and ``_reduce``: the
    results are bit for bit the same, with less host time (the custom op's wrapper and three autograd
    nodes per call). ``PYKERNELS_EAGER_LANE=0`` keeps the op-plus-reduction path."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, label_smoothing, graph_safe, dense, backend,
                max_valid, z_loss, reduction, num_valid, shape):
        loss, lse, rows, count = _fwd.impl(hidden, weight, target, bias, ignore_index, label_smoothing,
                                           graph_safe, dense, backend, max_valid, z_loss)
        ctx.save_for_backward(hidden, weight, target, bias, lse, rows, count)
        ctx.args = (ignore_index, label_smoothing, dense, backend, max_valid, graph_safe, z_loss)
        ctx.reduction = reduction
        loss = loss.reshape(shape)
        if reduction == "none":
            return loss
        total = loss.sum()
        if reduction == "sum":
            return total
        ctx.denom = _denominator(count, num_valid, total)
        return total / ctx.denom

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, bias, lse, rows, count = ctx.saved_tensors
        n = hidden.shape[0]
        if ctx.reduction == "none":
            grad_loss = grad.reshape(n)
        elif ctx.reduction == "sum":
            grad_loss = grad.expand(n)
        else:
            grad_loss = (grad / ctx.denom).expand(n)
        needs = ctx.needs_input_grad
        need_dh = needs[0]
        need_dw = needs[1] or (bias is not None and needs[3])
        ignore_index, label_smoothing, dense, backend, max_valid, graph_safe, z_loss = ctx.args
        dh, dw, db = _bwd(grad_loss, hidden, weight, target, bias, lse, rows, count, ignore_index,
                          label_smoothing, need_dh, need_dw, dense, backend, max_valid, graph_safe, z_loss)
        return (dh if need_dh else None, dw if needs[1] else None, None,
                db if bias is not None and needs[3] else None) + (None,) * 10


# ---- public function ---------------------------------------------------------------------------------

def check_options(*, label_smoothing=0.0, z_loss=0.0, graph_safe=False, dense=False, max_valid=None,
                  backend=None) -> tuple[float, float, int]:
    """:func:`masked_lm_loss`'s checks of its options (also what ``integrations.transformers.fuse_lm_loss`` checks
    up front): ``TypeError`` / ``ValueError`` naming the argument. Returns (label_smoothing, z_loss, max_valid as an
    int, 0 for None)."""
    label_smoothing = check_prob("label_smoothing", label_smoothing)
    z_loss = check_nonneg_float("z_loss", z_loss)
    if backend is not None and backend not in ("auto", "triton", "cuda", "reference"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'cuda', 'reference') or None, got {backend!r}")
    if not isinstance(graph_safe, bool):
        raise TypeError(f"graph_safe must be a bool, got {type(graph_safe).__name__}")
    if not isinstance(dense, bool):
        raise TypeError(f"dense must be a bool, got {type(dense).__name__}")
    if max_valid is None:
        max_valid = 0
    elif isinstance(max_valid, bool) or not isinstance(max_valid, int):
        raise TypeError(f"max_valid must be a positive int or None, got {type(max_valid).__name__}")
    elif max_valid <= 0:
        raise ValueError(f"max_valid must be a positive int (an upper bound of the valid targets), got {max_valid}")
    elif dense or graph_safe:
        raise ValueError("max_valid sizes the backward for at most max_valid valid targets; it cannot be combined "
                         f"with dense=True or graph_safe=True (got dense={dense}, graph_safe={graph_safe})")
    return label_smoothing, z_loss, max_valid


def masked_lm_loss(hidden: Tensor, weight: Tensor, target: Tensor, *, bias: Tensor | None = None,
                   ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                   num_valid=None, graph_safe: bool = False, dense: bool = False, max_valid: int | None = None,
                   z_loss: float = 0.0, backend: str | None = None) -> Tensor:
    """Cross-entropy of the LM head ``hidden @ weight.T + bias`` at the positions whose target is not
    ``ignore_index``, without materialising the logits.

    Args:
        hidden: (..., H) fp16, bf16 or fp32, any strides.
        weight: (V, H) the LM head / tied word embeddings, same dtype as ``hidden``.
        target: (...) integer (``hidden.shape[:-1]``); positions equal to ``ignore_index`` take no part.
        bias: optional (V,), same dtype as ``weight``.
        reduction: ``"mean"`` (sum over valid positions / number of valid positions in this call, or
            ``num_valid``; 0 when none is valid), ``"sum"``, or ``"none"`` (fp32 loss shaped like
            ``target``, 0 at ignored positions).
        label_smoothing: eps in [0, 1), as ``torch.nn.functional.cross_entropy`` defines it.
        z_loss: adds ``z_loss * lse**2`` at each valid position (PaLM's auxiliary loss that keeps the softmax
            normaliser near 1; as :func:`pykernels.cross_entropy`'s), lse the row's logsumexp over the vocabulary.
            No kernel of its own: the forward adds the term to the per-position loss, and the backward hands its
            kernels ``lse - log(1 + 2 z_loss lse)``, which scales each row's softmax by ``1 + 2 z_loss lse`` (the
            term's gradient), so every path (sized, dense, ``max_valid``, graph-safe, captured) keeps its speed.
            A row whose factor is negative (lse below ``-1 / (2 z_loss)``: every logit of the row below -5000 at
            ``z_loss=1e-4``) gets NaN gradients, never silently wrong ones. Not on the ``"cuda"`` backend.
        num_valid: int or tensor; with ``reduction="mean"`` divide by it instead of the local valid
            count (gradient accumulation over micro-batches divides by the global count).
        graph_safe: Triton path only. False (default): the forward copies the number of valid positions
            to the host without waiting, and the backward waits for that copy (an event recorded
            right after the forward's compaction, so the GPU neither drains nor idles) and then sizes its
            buffers and GEMMs for the valid rows only. True: nothing ever waits for the device; the
            backward's buffers and grids are sized for all N positions (slower at 15% masking, more
            memory). A call captured in a CUDA graph (``torch.cuda.graph``, ``torch.compile`` with
            ``mode="reduce-overhead"``) never waits either; its backward follows the valid count of the last
            eager backward of as many positions (the warm-up before the capture): for a capacity of that count
            plus 8 binomial standard deviations, the bounded backward (``max_valid``'s path for the capacity, the
            graph-safe kernels for any rows past it, skipped at replay where there are none; H200, BERT-base MLM:
            0.84 against 2.13 ms replayed), or the ``dense`` one where that capacity is at least 90% of N, as a
            causal LM's (GPT-2 size: 4.2 against 9.0 ms); graph-safe without a warm-up. Each is exact for any
            count at replay (past the capacity, dweight and dbias are rounded once more a block of overflow rows:
            twice for up to 512 rows past it); ``graph_safe=True`` named keeps the graph-safe backward.
        dense: Triton path only. True: the backward runs over every position as if all were valid, the
            ignored ones getting exactly zero gradient (their upstream gradient is masked to 0), with
            the sized backward's cuBLAS GEMMs: nothing waits for the device and the call can be captured
            in a CUDA graph at the sized path's speed. Right when nearly every target is valid (causal
            LM: one ignored position per sequence after :func:`shift_labels`); at 15% masking it does
            N / M = 6.7 times the backward's work, so leave it off for MLM. Overrides ``graph_safe``.
        max_valid: Triton path only: an upper bound of the number of valid targets, known to the caller
            (MLM: e.g. 20% of the tokens for 15% masking; with each of N tokens masked independently with
            probability p, ``N p + 8 sqrt(N p (1 - p))`` is exceeded about once in 10^15 batches, and is
            closer: 2823 of 16384 tokens at p = 0.15, against 3276 for 20%). The backward is then the sized one for
            ``max_valid`` rows, without the count copy or any wait: capturable in a CUDA graph at the sized
            path's speed, for any count up to the bound (the rows past the count are zero rows); a bound of
            N or more runs the ``dense`` backward (every position a row: no row gather).
            A call whose count exceeds ``max_valid`` gets NaN gradients (the loss is still right): never a
            silently partial gradient. Cannot be combined with ``dense`` or ``graph_safe``.
        backend: ``"auto" | "triton" | "cuda" | "reference"`` or None (the current default). ``"cuda"``: the
            CUDA C++ op (built with the extension; plain eager calls; it waits once for the valid count in
            the forward and sizes cuBLAS GEMMs for it; not with graph_safe, dense or max_valid). ``"auto"``
            takes the Triton kernels on a GPU.

    Returns:
        fp32 loss: a scalar, or shaped like ``target`` for ``reduction="none"``. Gradients flow to
        ``hidden`` (zero at ignored positions), ``weight`` and ``bias``.

    The Triton forward never waits for the device (the valid positions are compacted on the device).
    Memory of the backward besides the gradients: by default (the sized path) an (M, VC) dlogits buffer
    inside dhidden's memory when it fits there (few valid rows) with no more vocabulary chunks than the
    alternative, else of at most ``pykernels._kernels.masked_lm_loss.SIZED_DLOGITS_BUDGET_BYTES`` (16 MiB)
    plus dhidden's bytes (dhidden allocated after it is freed), the (M, H)
    gathered valid rows and an fp32 (M, H) dhidden accumulator, M = valid positions; graph-safe, an
    (N, VC) buffer of at most ``DLOGITS_BUDGET_BYTES`` (64 MiB) and an fp32 (N, H) accumulator. A target
    outside [0, V) that is not ``ignore_index`` gives a NaN loss on the Triton path (no out-of-bounds
    read) and a ValueError on the reference path.

    Causal LM (GPT): ``masked_lm_loss(hidden, wte, shift_labels(input_ids), dense=True)``.
    MLM (BERT): ``masked_lm_loss(sequence_output, word_embeddings, labels, bias=decoder_bias)`` with
    ``labels = -100`` at unmasked positions.
    """
    check_tensor("hidden", hidden, min_dim=1)
    check_tensor("weight", weight, ndim=2)
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in _INT_DTYPES:
        raise TypeError(f"target must have an integer dtype (int64 preferred), got {target.dtype}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden width {hidden.shape[-1]} (shape {tuple(hidden.shape)}) does not match "
                         f"weight width {weight.shape[1]} (shape {tuple(weight.shape)}): weight must be (V, H)")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one row (V >= 1), got shape {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has dtype {hidden.dtype}; they must match")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (V), got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias has dtype {bias.dtype} but weight has dtype {weight.dtype}; they must match")
    check_same([("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias)])
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    label_smoothing, z_loss, max_valid = check_options(label_smoothing=label_smoothing, z_loss=z_loss,
                                                       graph_safe=graph_safe, dense=dense, max_valid=max_valid,
                                                       backend=backend)
    if num_valid is not None:
        if reduction != "mean":
            raise ValueError(f"num_valid is only used with reduction='mean', got reduction={reduction!r}")
        if isinstance(num_valid, Tensor):
            if num_valid.numel() != 1:
                raise ValueError(f"num_valid must be a one-element tensor, got shape {tuple(num_valid.shape)}")
        elif isinstance(num_valid, bool) or not isinstance(num_valid, (int, float)):
            raise TypeError(f"num_valid must be an int or a tensor, got {type(num_valid).__name__}")
        elif num_valid <= 0:
            raise ValueError(f"num_valid must be positive, got {num_valid}")

    h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, H), a view when the strides allow
    t1 = target.reshape(-1).long()              # (N,)
    if _use_cuda(backend, h2, weight, t1, bias, graph_safe, dense, max_valid, num_valid, z_loss):
        nv_tensor, nv_host = None, -1.0
        if isinstance(num_valid, Tensor):
            nv_tensor = num_valid.to(device=h2.device, dtype=torch.float32).reshape(())
        elif num_valid is not None:
            nv_host = float(num_valid)
        loss = torch.ops.pykernels_cuda.masked_lm_loss(h2, weight, t1, bias, ignore_index, label_smoothing,
                                                       _REDUCTION_CODES[reduction], nv_tensor, nv_host)
        return loss.reshape(target.shape) if reduction == "none" else loss
    if (_LANE_ON and _plain_eager((h2, weight, t1, bias, num_valid))
            and not (isinstance(num_valid, Tensor) and num_valid.requires_grad)):
        return _EagerLoss.apply(h2, weight, t1, bias, ignore_index, label_smoothing, graph_safe, dense,
                                backend or "", max_valid, z_loss, reduction, num_valid, target.shape)
    loss, _, _, count = _fwd(h2, weight, t1, bias, ignore_index, label_smoothing, graph_safe, dense,
                             backend or "", max_valid, z_loss)
    return _reduce(loss.reshape(target.shape), target, ignore_index, reduction, num_valid, count)
