"""A layer's cache of staged disk chunks (issue 62): the disk rows of a chunk the device read at
one step stay in the layer's pinned mailbox, and a later step that selects the chunk again
reads them there instead of the worker copying them again (cpu.disk_copy, tiered.step.disk_stage).

A trained model's selections change little from one token to the next: the embedded model on
real text at 65,536 tokens re-selected 82.4% of a step's chunks at the next step (median over
its layers and heads 87.5%; `bench/probes/selection_overlap.py`). The random-weight model of the
speed figures re-selects 8.5%: there the cache saves little and costs nothing but its memory.

The mailbox's row buffers hold ``slots`` chunk slots of ``chunk`` rows each (CACHE times a
step's largest selection); each chunk-head key ``chunk id * H + head`` of a whole chunk owns at
most one slot, found through a hash table of 8 entries a slot or more (linear probing; a key
leaving moves the keys probed past it back). Per request, every selected disk chunk gets a
slot: its own if cached (these are found first), else the next slot by a
clock hand that this request has not taken (a step takes at most ``H * capc`` slots, no more
than the cache holds). The slots a request takes are stamped with its number, so nothing it
reads is overwritten while it is answered; a slot read by the device at step t is
overwritten only for a later request of the same
mailbox, which the worker answers after the device exported it, that is after step t's rows
kernel ran (disk_stage orders a mailbox's kernels). A partial chunk (the store's last tokens)
is copied every time, not cached. When the store's page lists were rewritten (a trim, an
undone append: ``epoch``, HostStore.rewrites), or its requests stage other tensors, every
entry is dropped first: a stored token's rows change only then. Memory: the row buffers are
CACHE times what one step's selection needs (pinned), the table and the slots' words about
80 bytes a slot (not pinned).
"""

from __future__ import annotations

import os

import numpy as np

from ._numba import kernel

CACHE = max(1, int(os.environ.get("TIERED_DISK_CACHE", "2")))  # slots per selectable chunk-head
# state words: the clock hand, the store's rewrite count + 1 (0: none), the last request, the
# tensors its requests stage
HAND, EPOCH, LAST, TENSORS = 0, 1, 2, 3
_MIX = np.uint64(0x9E3779B97F4A7C15)


class CacheMap:
    """The host side of a mailbox's chunk cache: table (hash -> slot, -1 empty), owner (slot ->
    key, -1 free: a slot with an owner holds that chunk's whole rows), stamp (slot -> the last
    request that took it), state (HAND, EPOCH, LAST, TENSORS)."""

    def __init__(self, slots: int):
        bits = max(4, int(8 * slots - 1).bit_length())  # >= 8 entries a slot: short probes
        self.table = np.full(1 << bits, -1, np.int64)
        self.owner = np.full(slots, -1, np.int64)
        self.stamp = np.zeros(slots, np.int64)
        self.state = np.zeros(4, np.int64)
        self.bits = bits


@kernel(inline=True)
def _hash(key, bits):
    return np.int64((np.uint64(key) * _MIX) >> np.uint64(64 - bits))


@kernel(inline=True)
def _find(table, bits, owner, key):
    """The slot holding ``key`` (linear probing from its hash), or -1."""
    mask = (np.int64(1) << bits) - 1
    b = _hash(key, bits)
    while table[b] >= 0:
        if owner[table[b]] == key:
            return table[b]
        b = (b + 1) & mask
    return np.int64(-1)


@kernel(inline=True)
def _insert(table, bits, key, cs):
    mask = (np.int64(1) << bits) - 1
    b = _hash(key, bits)
    while table[b] >= 0:
        b = (b + 1) & mask
    table[b] = cs


@kernel(inline=True)
def _remove(table, bits, owner, key):
    """Drop ``key``'s entry; the entries probed past it move back (no tombstones), so every
    key stays reachable from its hash. ``owner`` still names every entry's key."""
    mask = (np.int64(1) << bits) - 1
    i = _hash(key, bits)
    while table[i] >= 0 and owner[table[i]] != key:
        i = (i + 1) & mask
    if table[i] < 0:
        return
    j = i
    while True:
        j = (j + 1) & mask
        if table[j] < 0:
            break
        home = _hash(owner[table[j]], bits)
        # stays where its home lies cyclically in (i, j]; else moves into the gap at i
        if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
            continue
        table[i] = table[j]
        i = j
    table[i] = -1


@kernel(inline=True)
def assign(idx, blks, start, slots, capc, H, C, job, epoch, tensors, table, bits, owner, stamp,
           state, cslot, copy):
    """Give every selection slot k whose chunk lies on disk (blks[k] >= 0; start[k + 1] -
    start[k] rows) a cache slot cslot[k], and copy[k] = 1 where its rows must be copied there
    (else 0: cached); -1 and 0 elsewhere. The cached chunks are found first, so no chunk this
    request reads from the cache gives its slot to another. Returns (rows to copy, chunk-heads
    to copy)."""
    if state[EPOCH] != epoch + 1 or state[TENSORS] != tensors:  # the store was rewritten
        table[:] = -1  # since, or the slots hold other tensors' rows (or nothing cached yet)
        owner[:] = -1
        state[EPOCH], state[TENSORS] = epoch + 1, tensors
    if job <= state[LAST]:  # numbers out of order (a test's, a probe's): no slot is taken
        stamp[:] = 0
    state[LAST] = job
    for k in range(slots):  # the cached ones
        cslot[k], copy[k] = -1, 0
        if blks[k] < 0:
            continue
        n = start[k + 1] - start[k]
        if n != C:
            copy[k] = 1  # a partial chunk: copied, not cached
            continue
        key = np.int64(idx[k]) * H + k // capc
        cs = _find(table, bits, owner, key)
        if cs >= 0:
            stamp[cs] = job
            cslot[k] = cs
        else:
            copy[k] = 1
    n_slots = owner.size
    hand = state[HAND] % n_slots
    rows_out, chunks_out = 0, 0
    for k in range(slots):  # the others, each into a slot this request does not read
        if copy[k] == 0:
            continue
        while stamp[hand] == job:  # ends: this request takes fewer slots than there are
            hand = hand + 1 if hand + 1 < n_slots else 0
        cs = hand
        hand = hand + 1 if hand + 1 < n_slots else 0
        if owner[cs] >= 0:
            _remove(table, bits, owner, owner[cs])
        n = start[k + 1] - start[k]
        key = np.int64(idx[k]) * H + k // capc if n == C else np.int64(-1)
        owner[cs] = key
        stamp[cs] = job
        if key >= 0:
            _insert(table, bits, key, cs)
        cslot[k] = cs
        rows_out += n
        chunks_out += 1
    state[HAND] = hand
    return rows_out, chunks_out
