"""What a refresh of the resident set changes: which tokens stay (and in which old slot), which
come in (promoted), which leave (demoted).

One pass over the old and new token ids per head, through a token -> slot scratch row that is
reset after use: O(resident slots) per refresh instead of the (heads, tokens) maps numpy needs
(8 x 128k entries built twice per refresh at 128k tokens, the largest host cost of a refresh
on an accelerator; issue 24).
"""

from __future__ import annotations

import threading

import numpy as np

from ._numba import kernel


@kernel("void(int32[:, ::1], int32[:, ::1], int32[::1], int32[:, ::1], int32[:, ::1], "
        "int32[:, ::1], int32[:, ::1], int32[:, ::1], int64[:, ::1])")
def _match(old, new, scratch, src, prom, dem, dem_tok, changes, counts):
    H, Ro = old.shape
    Rn = new.shape[1]
    c = 0  # flag changes so far: changes[0] heads, [1] tokens, [2] values
    for h in range(H):
        for j in range(Ro):
            t = old[h, j]
            if t >= 0:
                scratch[t] = j
        p = 0
        for j in range(Rn):
            t = new[h, j]
            if t < 0:
                src[h, j] = 0
                continue
            s = scratch[t]
            if s >= 0:
                src[h, j] = s
                scratch[t] = -2  # kept: not demoted
            else:
                src[h, j] = Ro + p
                prom[h, p] = t
                p += 1
        for j in range(p, Rn):
            prom[h, j] = -1
        d = 0
        for j in range(Ro):
            t = old[h, j]
            if t >= 0:
                if scratch[t] >= 0:
                    dem[h, d] = j
                    dem_tok[h, d] = t
                    changes[0, c] = h
                    changes[1, c] = t
                    changes[2, c] = 0
                    c += 1
                    d += 1
                scratch[t] = -1
        for j in range(d, Ro):
            dem[h, j] = 0
            dem_tok[h, j] = -1
        for j in range(p):
            changes[0, c] = h
            changes[1, c] = prom[h, j]
            changes[2, c] = 1
            c += 1
        counts[0, h] = p
        counts[1, h] = d
    counts[2, 0] = c


@kernel("void(int32[:, ::1], int64, int32[:, ::1], int64[::1], int32[:, ::1], int64[::1], "
        "int32[:, ::1], int32[:, ::1], int32[:, ::1], int32[:, ::1])")
def _place(old, fixed, prom, pcount, dem, dcount, tgt, tok, kind, new):
    H, R = old.shape
    m = tgt.shape[1]
    for h in range(H):
        for j in range(R):
            new[h, j] = old[h, j]
        p, d = pcount[h], dcount[h]
        e = 0  # entries so far: the freed slots (demoted ones first, then empty ones) in order
        for i in range(d):
            s = dem[h, i]
            tgt[h, e] = s
            tok[h, e] = prom[h, e] if e < p else -1
            kind[h, e] = 0 if e < p else 1
            new[h, s] = tok[h, e]
            e += 1
        for j in range(fixed, R):
            if e >= p:
                break
            if old[h, j] < 0:
                tgt[h, e] = j
                tok[h, e] = prom[h, e]
                kind[h, e] = 0
                new[h, j] = prom[h, e]
                e += 1
        for i in range(e, m):  # padding: slot 0 (fixed, never an entry) rewritten as it is
            tgt[h, i] = 0
            tok[h, i] = old[h, 0]
            kind[h, i] = 2


_lock = threading.Lock()
_scratch = np.full(0, -1, np.int32)


class Swap:
    """A refresh from token ids ``old`` (H, Ro) to ``new`` (H, Rn) (-1: empty slot).

    - ``src`` (H, Rn): per new slot, its old slot when the token was resident, else
      Ro + its rank among the head's promoted tokens (rows of concat(old rows, promoted rows));
      0 for empty slots;
    - ``promoted`` (H, mp) token ids, first ``promoted_count[h]`` per head, then -1;
    - ``demoted_slots`` (H, md) old slots of the tokens that leave, first
      ``demoted_count[h]`` per head, then 0; ``demoted`` (H, md) their ids, then -1.
    """

    def __init__(self, old: np.ndarray, new: np.ndarray):
        global _scratch
        old = np.ascontiguousarray(old, np.int32)
        new = np.ascontiguousarray(new, np.int32)
        H, Ro = old.shape
        Rn = new.shape[1]
        top = max(int(old.max(initial=-1)), int(new.max(initial=-1))) + 1
        src = np.empty((H, Rn), np.int32)
        prom = np.empty((H, Rn), np.int32)
        dem = np.empty((H, Ro), np.int32)
        dem_tok = np.empty((H, Ro), np.int32)
        changes = np.empty((3, H * (Ro + Rn)), np.int32)
        counts = np.zeros((3, H), np.int64)
        with _lock:  # one scratch row, all -1 between calls
            if _scratch.shape[0] < top:
                _scratch = np.full(max(top, 2 * _scratch.shape[0]), -1, np.int32)
            _match(old, new, _scratch, src, prom, dem, dem_tok, changes, counts)
        self.src = src
        self.promoted_count, self.demoted_count = counts[0], counts[1]
        self.promoted = prom[:, : int(counts[0].max(initial=0))]
        md = int(counts[1].max(initial=0))
        self.demoted_slots = dem[:, :md]
        self.demoted = dem_tok[:, :md]
        self._changes = changes[:, : int(counts[2, 0])]

    def in_place(self, old: np.ndarray, fixed: int):
        """The same refresh as writes into the old layout: each promoted token takes a freed
        slot (a demoted token's, in order, then an empty one past the ``fixed`` slots: the
        sinks and the ring, which every refresh keeps), demoted slots left over become empty.
        Returns (slots, tokens, kind, new layout, promoted): per head the entries' slots and
        tokens (H, m) and kind 0 (a promoted token's row, ``promoted[h, i]`` for entry i), 1
        (an emptied slot: a zero row, token -1) or 2 (padding: slot 0 written as it is), the
        new token ids (H, R), and the promoted ids padded with -1 to (H, m). m is the most
        entries of a head (at least 1)."""
        old = np.ascontiguousarray(old, np.int32)
        H = old.shape[0]
        p, d = self.promoted_count, self.demoted_count
        m = max(1, int(np.maximum(p, d).max(initial=0)))
        prom = np.full((H, m), -1, np.int32)
        prom[:, : self.promoted.shape[1]] = self.promoted
        dem = np.zeros((H, max(1, self.demoted_slots.shape[1])), np.int32)
        dem[:, : self.demoted_slots.shape[1]] = self.demoted_slots
        tgt, tok, kind = (np.empty((H, m), np.int32) for _ in range(3))
        new = np.empty_like(old)
        _place(old, int(fixed), prom, np.ascontiguousarray(p, np.int64), dem,
               np.ascontiguousarray(d, np.int64), tgt, tok, kind, new)
        return tgt, tok, kind, new, prom

    def flag_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(heads, tokens, value) of the resident flags that change: 0 for the demoted tokens,
        1 for the promoted ones (listed by the same pass that finds them)."""
        heads, toks, value = self._changes
        return heads, toks, value.astype(np.uint8)
