"""`draw_cache`: a pair's forced draws read back from disk are the draws themselves; a file that does not read
back whole is drawn again; ``ZEROSTATE_DRAW_CACHE=0`` draws every time and keeps nothing."""

from __future__ import annotations

import pytest

from zerostate.explorer import draw_cache
from zerostate.explorer.pairs import DRAWS, _seed, all_pairs, draws, forced


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROSTATE_CACHE", str(tmp_path))
    monkeypatch.setenv(draw_cache.ENV, "1")
    return tmp_path


_FORCEABLE = [p for p in all_pairs() if forced(p) is not None]
PAIRS = _FORCEABLE[:3] + _FORCEABLE[-2:]
"""Pairs whose alternatives can be forced together (the others have no draws: None, never kept)."""


def test_kept_draws_are_the_draws(cache, monkeypatch):
    monkeypatch.setenv(draw_cache.ENV, "0")
    fresh = [draws(p, None) for p in PAIRS]
    assert not (cache / "draws").exists(), "turned off, nothing is kept"
    monkeypatch.setenv(draw_cache.ENV, "1")
    first = [draws(p, None) for p in PAIRS]  # drawn and kept
    kept = [draw_cache.load(p, _seed(None, p), DRAWS) for p in PAIRS]
    assert all(k is not None for k in kept) and kept == fresh == first
    assert [draws(p, None) for p in PAIRS] == fresh  # read back


def test_draws_reads_what_is_kept_instead_of_drawing(cache):
    pair = PAIRS[0]
    drawn = draws(pair, None)
    assert drawn is not None and len(set(drawn)) > 1
    draw_cache.store(pair, _seed(None, pair), DRAWS, drawn[::-1])  # kept draws no drawing would give
    assert draws(pair, None) == drawn[::-1]


def test_a_file_that_does_not_read_back_is_drawn_again_and_written_over(cache):
    pair = PAIRS[0]
    want = draws(pair, None)
    path = draw_cache.path_for(pair, _seed(None, pair), DRAWS)
    path.write_text(path.read_text()[:-40])  # cut short, as by a full disk
    assert draw_cache.load(pair, _seed(None, pair), DRAWS) is None
    assert draws(pair, None) == want
    assert draw_cache.load(pair, _seed(None, pair), DRAWS) == want


def test_the_key_is_the_pair_the_seed_and_the_code():
    a = draw_cache.path_for(PAIRS[0], 1, DRAWS)
    assert a != draw_cache.path_for(PAIRS[1], 1, DRAWS) != draw_cache.path_for(PAIRS[0], 2, DRAWS)
    assert a.parent.name == draw_cache.code_digest() and len(draw_cache.code_digest()) == 16
