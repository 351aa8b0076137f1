"""Which kept K/V a new answer reuses, and which is given up first."""

from peerd.inference.prefixes import MIN_REUSE, PrefixCache, Reuse

HISTORY = list(range(100, 140))


def test_the_longest_shared_prefix_is_reused_and_the_last_prompt_token_still_runs():
    cache = PrefixCache()
    cache.keep("short", HISTORY[:20])
    cache.keep("long", HISTORY[:30] + [7, 7])
    assert cache.reuse(HISTORY + [1, 2]) == Reuse("long", 30)
    assert cache.reuse(HISTORY[:20]) == Reuse("short", 19)


def test_a_prompt_sharing_too_little_or_nothing_starts_afresh():
    cache = PrefixCache()
    cache.keep("a", HISTORY)
    assert cache.reuse(HISTORY[: MIN_REUSE - 1] + [1, 2, 3]) is None
    assert cache.reuse([5] + HISTORY) is None


def test_the_least_recently_used_goes_first_by_count_and_by_room():
    cache = PrefixCache(most=2)
    assert cache.keep("a", HISTORY[:20]) == []
    assert cache.keep("b", HISTORY[:25]) == []
    assert cache.reuse(HISTORY[:23]) == Reuse("b", 22)  # "b" is now the most recent
    assert cache.keep("c", HISTORY[:30]) == ["a"]
    assert cache.tokens == 55
    assert cache.within(40) == ["b"]
    assert cache.within(40) == [] and len(cache) == 1
    assert cache.clear() == ["c"] and cache.tokens == 0
