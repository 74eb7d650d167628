"""What a compressed layer gives back and saves: exact trim through the undo journal
(:mod:`tiered.step.undo`), the scores a past step saw, and ``state`` / ``from_state``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..planning.planner import capacity
from ..runtime import dispatch, ops
from ..step import chunk_select, undo
from ..step.keys import AffineKeys, CodebookKeys
from .trim import trim_compressed


class CompressedState:
    """Methods of :class:`tiered.layer.compressed.CompressedLayer` (see the module docstring)."""

    def restore_blocks(self, payload):
        """Undo a chunk's or the decode start's change of the block-wise prefill's blocks."""
        self.local_start, self.local_k, self.local_v, self._prev_local = payload[:4]
        if len(payload) > 4:
            self.anchor_k, self.anchor_v = payload[4:]

    def step_scores(self, q: mx.array, rep: int):
        """A decode step's scores z (every token; the resident ones exact) and their softmax
        max m and sum s per query head, recomputed for the layer as it is (tiered.step.undo)."""
        H, d = self.H, q.shape[-1]
        Hq = q.shape[0]
        s_r = self._resident_scores(q.reshape(H, rep, d))
        if not self.numpy_path:
            z, sel = self._select_device(q, s_r, Hq, rep)
            return z, sel.m, sel.s
        dispatch.eval(q, s_r)
        z = self._scores_with_resident(q, np.array(q), s_r, rep)
        cap, floor = self._cap(self.n)
        sel = chunk_select.select_np(z, self.n, self.n, self._flags_np, self.tau, cap,
                                     floor)
        return z, sel.m, sel.s

    def _scores_with_resident(self, q, q_np, s_r, rep):
        """numpy scores (Hq, n) from the codes, the resident tokens' replaced by their exact
        scores s_r (they enter the policy's softmax exactly)."""
        z = self.keys.scores(q, self.n, rep, q_np)
        tok = self._res_tok_np
        s_np = np.array(s_r).reshape(z.shape[0], -1)
        for h in range(z.shape[0]):
            valid = tok[h // rep] >= 0
            z[h, tok[h // rep][valid]] = s_np[h][valid]
        return z

    # ---- trim and persistence --------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n_trim: int) -> int:
        """Give back the last n_trim tokens, all or nothing: undone through the journal
        (tiered.step.undo), so that feeding them again reproduces the first feed; past the journal,
        the tokens go and the resident set is rebuilt from the policy (tiered.layer.trim)."""
        return trim_compressed(self, n_trim)

    def state(self) -> dict:
        self.settle()
        n = self.n
        st = {
            "plan": self.plan.to_json(),
            "n": n,
            "steps": self.steps,
            "scale": float(self.scale) if self.scale is not None else -1.0,
            "keys": self.keys.state(n),
            "flags": self.flags[:, :n],
            "res_k": self.res_k,
            "res_v": self.res_v,
            "res_tok": self.res_tok,
            "layout": [self.S_eff, self.W_eff],
        }
        if self.heavy is not None:
            st["acc"] = self.heavy.acc[:, :n]
        if self._host_outliers is not None:
            st["outliers"] = [mx.array(self._host_outliers), mx.array(self._outlier_err)]
        if self.anchor_k is not None:  # block-wise prefill in progress: its blocks travel too
            st["anchor"] = [self.anchor_k, self.anchor_v]
        if self.local_k is not None:
            st["local"] = [self.local_k, self.local_v]
            st["local_start"] = self.local_start
        return st

    @classmethod
    def from_state(cls, parent, st):
        plan = parent.context.adopt_plan(st["plan"], layer=parent.layer)
        n = int(st["n"])
        cap = capacity(n, plan.step)
        g = parent.geometry
        H, dk, dtype = g.kv_heads, g.k_dim, g.dtype
        ks = st["keys"]
        if ks["kind"] == "affine":
            store = AffineKeys.from_state(ks, H, dk, plan.affine_bits, plan.affine_group_size,
                                          plan.step, dtype)
        else:
            store = CodebookKeys.from_state(ks, H, plan.step, ops.numpy_path(parent.config))
        self = cls(parent, plan, store, cap)
        self.n, self.steps = n, int(st["steps"])
        self.journal = undo.Journal(n, parent.config.undo_tokens)
        self.scale = None if st["scale"] < 0 else float(st["scale"])
        if self.numpy_path:
            self._flags_np[:, :n] = np.array(st["flags"])
        else:
            self.flags[:, :n] = st["flags"]
        if self.heavy is not None and "acc" in st:
            self.heavy.set(0, st["acc"])
        self.S_eff, self.W_eff = (int(x) for x in st["layout"])
        self._set_resident(mx.array(st["res_k"]), mx.array(st["res_v"]),
                           np.array(st["res_tok"]).astype(np.int32))
        if "outliers" in st:
            self._host_outliers = np.array(st["outliers"][0]).astype(np.int32)
            self._outlier_err = np.array(st["outliers"][1]).astype(np.float32)
        if "anchor" in st:
            self.anchor_k, self.anchor_v = st["anchor"]
        if "local" in st:
            self.local_k, self.local_v = st["local"]
            self.local_start = int(st["local_start"])
        return self
