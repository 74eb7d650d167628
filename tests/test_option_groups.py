"""TieredConfig's grouped views: every flat option in exactly one group (or one of the few that
concern the whole cache), read-only, equal to the flat options they are built from."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from tiered import TieredConfig
from tiered.options.option_groups import GROUPS, UNGROUPED


def test_every_option_is_in_one_group():
    flat = [f.name for f in dataclasses.fields(TieredConfig) if f.name != "_"]
    grouped = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(grouped) == len(set(grouped)), "an option in two groups"
    assert sorted(grouped + list(UNGROUPED)) == sorted(flat)


def test_views_read_the_flat_options():
    cfg = TieredConfig(0.25, tau=0.95, max_selected=0.05, min_selected=8, recent=128,
                       refresh_every=4, page_size=64, lookahead=True, codebook_groups=16)
    assert cfg.selection.tau == 0.95 and cfg.selection.rescore == "exact"
    assert cfg.resident.recent == 128 and cfg.host.page_size == 64
    assert cfg.decode.lookahead is True and cfg.codec.codebook_groups == 16
    for name, cls in GROUPS.items():
        view = getattr(cfg, name)
        assert isinstance(view, cls)
        for f in dataclasses.fields(cls):
            assert getattr(view, f.name) == getattr(cfg, f.name), (name, f.name)


def test_views_are_read_only_and_not_options():
    cfg = TieredConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.selection.tau = 0.5
    with pytest.raises(AttributeError, match="read-only view: set the options it holds"):
        cfg.selection = None
    assert set(GROUPS).isdisjoint(cfg.to_dict())
    with pytest.raises(ValueError, match="selection"):
        TieredConfig.from_kwargs(selection=None)


def test_selection_cap_and_heavy_horizon():
    assert TieredConfig(max_selected=100).selection.cap(10_000) == 100
    assert TieredConfig(max_selected=0.01).selection.cap(10_000) == 100
    assert TieredConfig(max_selected=0.01).selection.cap(10) == 1
    assert TieredConfig(refresh_every=16).heavy.horizon == 17


def test_views_are_kept_until_an_option_changes():
    cfg = TieredConfig(tau=0.9, recent=64)
    first = cfg.selection
    assert cfg.selection is first  # read every layer of every step: built once
    cfg.tau = 0.5
    assert cfg.selection is not first and cfg.selection.tau == 0.5 and first.tau == 0.9
    resident = cfg.resident
    cfg.recent = 128
    assert cfg.resident.recent == 128 and resident.recent == 64
    twin = copy.deepcopy(cfg)
    twin.tau = 0.7
    assert twin.selection.tau == 0.7 and cfg.selection.tau == 0.5
