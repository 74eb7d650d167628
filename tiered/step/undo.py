"""Undo journal of a compressed layer: what ``trim`` needs to give the last tokens back exactly.

A compressed layer changes more than its token count when tokens come in: the recent ring
overwrites resident slots, a decode step moves the H2O accumulators, every ``refresh_every``
steps the resident set is rebuilt, a prompt chunk replaces the local block. ``trim(n)`` then
feeding the same n tokens must reproduce the first feed, so each change is journaled with what
it overwrote, and trim undoes the entries of the trimmed tokens, newest first:

- ``append``: the ring slots written, the tokens and K/V rows they held (restored as they were);
- ``step``: the step's scaled query. The accumulator update acc = alpha acc + (1 - alpha) p
  is inverted with p recomputed from that query over the same codes and resident set (the
  journal restores those first): equal up to float rounding;
- ``refresh``: the resident token ids before it, and the K/V rows of the tokens it demoted
  (the promoted ones are dropped again): restored exactly;
- ``chunk`` / ``prefill_end``: the block-wise prefill's blocks before the change;
- ``outliers``: the host outliers before a prompt chunk's were noted.

Only the last ``undo_tokens`` tokens are journaled (a trim reaching further back, or past the
compression, rebuilds the resident set from the policy, as a refresh does, and says so once).
A trim into a journaled prompt chunk undoes the chunk and appends its first tokens again
(:func:`tiered.layer.trim.replay_chunk`).
"""

from __future__ import annotations

import logging
from collections import deque

import mlx.core as mx
import numpy as np

from ..cpu.resident_maps import Swap
from ..runtime import dispatch

log = logging.getLogger("tiered")


class Journal:
    def __init__(self, n: int, limit: int):
        # (n after the change, kind, payload), oldest first: a deque, as the oldest leave at
        # every record (list.pop(0) moved the whole list: 2.8% of a 128k token's host time in
        # a native profile on an H200)
        self.entries: deque[tuple[int, str, tuple]] = deque()
        self.horizon = n  # the smallest token count a trim can restore exactly
        self.limit = limit
        self.warned = False

    def record(self, n_after: int, kind: str, payload: tuple) -> None:
        if self.limit <= 0:
            self.horizon = max(self.horizon, n_after)
            return
        self.entries.append((n_after, kind, payload))
        while self.entries and self.entries[0][0] <= n_after - self.limit:
            self.horizon = max(self.horizon, self.entries.popleft()[0])

    def covers(self, n_target: int) -> bool:
        return n_target >= self.horizon

    def pop_after(self, n_target: int):
        """Entries newer than n_target tokens, newest first (removed from the journal)."""
        while self.entries and self.entries[-1][0] > n_target:
            yield self.entries.pop()

    def forget(self, n: int) -> None:
        """Nothing before n tokens can be restored any more (a fallback rebuild happened)."""
        self.entries.clear()
        self.horizon = n


def _slot_index(slots):
    """A static slice for one slot or a run of consecutive ones (a decode token; a prompt
    chunk ending at a multiple of the ring's size), else an index array (on a GPU each costs
    an upload, and making one waited for the driver's lock beside the dispatcher thread:
    py-spy, 2048-token prefill chunks of a Llama-3-8B on an H200, 8% of the samples)."""
    slots = np.asarray(slots, np.int32)
    if slots.size and np.all(np.diff(slots) == 1):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return mx.array(slots)


def shared_run(tokens: np.ndarray):
    """A slice for token ids (H, m) that are the same consecutive run in every head (what a
    prompt chunk evicts from the ring), else None: the flags are then cleared without
    uploading two index arrays per layer and chunk (see _slot_index)."""
    if not tokens.size or not np.all(tokens == tokens[:1]):
        return None
    row = np.sort(tokens[0])
    if not np.all(np.diff(row) == 1):
        return None
    return slice(int(row[0]), int(row[-1]) + 1)


def ring_rows(layer, slots, step: bool = True, gone: int | None = None) -> tuple:
    """What a ring insert into ``slots`` overwrites: token ids (H, m) and K/V rows (H, m, d).

    A ring slot holding token t holds t's own K/V rows, so on an accelerator a decode token
    (one slot, the same token in every head) journals the rows kept when t entered the ring
    (``layer.ring_src``): no copy and no hand-off to the device (each ``async_eval`` costs
    ~0.2 ms of host time on MLX CUDA). Otherwise the rows are copies, evaluated now on the
    CPU backend and with the layer's next step on an accelerator. A slice (lazy, or evaluated:
    a view) shares res_k / res_v's buffer until an undo that rarely comes, so the insert that
    follows could not update them in place and copied them in full every step (MLX CPU,
    3 x 8192 x 64 float32: 2.8-5.2 ms per update instead of 0.13-0.4), and the journal kept up
    to undo_tokens old copies alive.

    ``step``: a decode token's insert (its copies wait in ``layer._later`` for the step); a
    prompt chunk's copies are the caller's to tie to the ring (CompressedLayer._ring_insert):
    no step comes during a prompt, and held lazy, each kept the ring's buffer as of its chunk
    (47 GiB of a 1M-token prefill of a Llama-3-8B on an H200)."""
    one = len(slots) == 1  # a decode token: a basic slice, not numpy's fancy indexing
    old_tok = layer._res_tok_np[:, int(slots[0]) : int(slots[0]) + 1].copy() if one else (
        layer._res_tok_np[:, slots].copy())
    t = int(old_tok[0, 0]) if old_tok.size else -1
    # ``gone``: the caller saw every head's slot hold that token (the device append)
    if one and t in layer.ring_src and (t == gone or np.all(old_tok == t)):
        return (old_tok,) + layer.ring_src.pop(t)
    idx = _slot_index(slots)
    k, v = mx.array(layer.res_k[:, idx]), mx.array(layer.res_v[:, idx])
    if layer.numpy_path:
        dispatch.eval(k, v)
    elif step:  # evaluated with the layer's next step (CompressedLayer._later): no hand-off
        layer._later += [k, v]
    return old_tok, k, v


def undo_append(layer, n0: int, slots, old_tok, old_k, old_v) -> None:
    layer.ring_src.pop(n0, None)  # the token given back leaves the ring
    if len(slots) == 1 and old_tok.size and np.all(old_tok == old_tok[0, 0]) and old_tok[0, 0] >= 0:
        layer.ring_src[int(old_tok[0, 0])] = (old_k, old_v)  # and the one it evicted is back
    idx = _slot_index(slots)
    layer.res_k[:, idx] = old_k
    layer.res_v[:, idx] = old_v
    layer._res_tok_np[:, slots] = old_tok
    layer.res_tok = mx.array(layer._res_tok_np)
    layer.n = n0
    flags_from_resident(layer)


def undo_refresh(layer, old_tok, S_eff, W_eff, toks, rows_k, rows_v) -> None:
    """The resident set as it was: kept rows from the current set, demoted ones from the
    journal."""
    # The tokens the refresh demoted come back in old_tok's slot order, as they were journaled
    sw = Swap(layer._res_tok_np, old_tok)
    if not np.array_equal(sw.promoted, toks[:, : sw.promoted.shape[1]]):
        raise RuntimeError(f"layer {layer.parent.layer}: the undo journal's refresh entry does "
                           "not match the resident set (a change was not journaled)")
    src = sw.src
    idx = mx.array(src)[..., None]
    k = mx.take_along_axis(mx.concatenate([layer.res_k, rows_k], axis=1), idx, axis=1)
    v = mx.take_along_axis(mx.concatenate([layer.res_v, rows_v], axis=1), idx, axis=1)
    valid = mx.array(old_tok >= 0)[..., None]
    k, v = mx.where(valid, k, 0), mx.where(valid, v, 0)
    dispatch.eval(k, v)
    layer.S_eff, layer.W_eff = S_eff, W_eff
    layer._set_resident(k, v, old_tok)
    flags_from_resident(layer)


def undo_step(layer, n: int, q: mx.array, rep: int, steps: int) -> None:
    """Invert a decode step's accumulator update (see the module docstring)."""
    layer.steps = steps
    stats = layer.parent.stats
    if stats.decode_steps:
        stats.decode_steps -= 1
        for lst in (stats.selected, stats.live, stats.resident_mass):
            if lst:
                lst.pop()
    if layer.heavy is not None:
        z, m, s = layer.step_scores(q, rep)
        layer.heavy.undo(z, m, s, n, rep)


def resident_mask(tok: np.ndarray, n: int) -> np.ndarray:
    """(H, n) bool: True where token t < n is in row h of ``tok`` (H, R) (-1: empty)."""
    H = tok.shape[0]
    out = np.zeros((H, n), bool)
    ok = (tok >= 0) & (tok < n)
    out[np.broadcast_to(np.arange(H)[:, None], tok.shape)[ok], tok[ok]] = True
    return out


def flags_from_resident(layer) -> None:
    """flags[h, t] = 1 exactly where token t is resident for head h (the layer's invariant)."""
    n = layer.n
    flags = resident_mask(layer._res_tok_np, n).view(np.uint8)
    if layer.numpy_path:
        layer._flags_np[:, :n] = flags
    else:
        layer.flags[:, :n] = mx.array(flags)


def warn_once(layer) -> None:
    j = layer.journal
    if not j.warned:
        j.warned = True
        log.warning("tiered: layer %d trimmed back past its undo journal (%d tokens): the "
                    "resident set is rebuilt from the policy", layer.parent.layer, j.limit)


def entry_around(journal: Journal, n_target: int) -> tuple[int, int] | None:
    """(n0, n_after) of the journaled append of several tokens (a prompt chunk) that n_target
    falls strictly inside, else None."""
    for n_after, kind, payload in reversed(journal.entries):
        if n_after <= n_target:
            return None
        if kind == "append" and payload[0] < n_target:
            return payload[0], n_after
    return None


def undo(layer, n_target: int, blocks: dict | None = None) -> bool:
    """Undo every change newer than n_target tokens; False when the journal does not reach
    back that far (nothing is undone then). ``blocks``: receives, by the entry's token count,
    the local block (start, K, V) each undone chunk entry replaces (the chunk's own K/V)."""
    j = layer.journal
    if not j.covers(n_target):
        warn_once(layer)
        return False
    for n_after, kind, payload in j.pop_after(n_target):
        if kind == "append":
            undo_append(layer, *payload)
        elif kind == "step":
            undo_step(layer, *payload)
        elif kind == "refresh":
            undo_refresh(layer, *payload)
        elif kind in ("chunk", "prefill_end"):
            if kind == "chunk" and blocks is not None:
                blocks[n_after] = (layer.local_start, layer.local_k, layer.local_v)
            layer.restore_blocks(payload)
        elif kind == "outliers":
            layer._host_outliers, layer._outlier_err = payload
    return True
