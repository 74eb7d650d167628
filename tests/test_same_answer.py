"""The same tokens give the same answer whatever path fed them (issue 58): the whole prompt
through mlx-lm's stream_generate, and the document prefilled by tiered.prefill in chunks (what
``tiered run`` does), saved, loaded and then asked, at gpu_budget 0.125 with greedy decoding,
give the same tokens."""

from __future__ import annotations

import mlx_lm

import tiered
from tiered.prefill import prefill
from tiered.planning.tasks import passkey


def test_cli_generate_and_a_saved_cache_give_the_same_tokens(embedded, tmp_path):
    model, tok = embedded
    sample = passkey(tok, 1200, 0.4, seed=3)
    ids = tok.encode(sample.prompt)
    prefix, suffix = ids[:-24], ids[-24:]  # the document, then its question's tokens

    def answer(cache, prompt):
        out = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=8,
                                                       prompt_cache=cache)]
        assert all(c.phase == "compressed" for c in cache)  # the answers read compressed layers
        cache.close()
        return out

    want = answer(tiered.TieredCache.for_model(model, 0.125), prefix + suffix)
    assert tok.decode(want).strip().startswith(sample.answer)  # a case the full cache passes
    saved = tiered.TieredCache.for_model(model, 0.125)
    prefill(model, saved, prefix, chunk=500)
    saved.save(str(tmp_path / "doc"), model)
    saved.close()
    assert answer(tiered.TieredCacheList.load(str(tmp_path / "doc"), model), suffix) == want
