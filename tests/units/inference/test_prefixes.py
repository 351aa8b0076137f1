"""Which kept K/V a new answer takes over, and which is given up first."""

from peerd.inference.prefixes import MIN_REUSE, PrefixCache, Reuse

HISTORY = list(range(100, 140))


def test_the_longest_shared_prefix_is_taken_over_and_the_last_prompt_token_still_runs():
    cache = PrefixCache()
    cache.keep("short", HISTORY[:20])
    cache.keep("long", HISTORY[:30] + [7, 7])
    assert cache.take(HISTORY + [1, 2]) == Reuse("long", 30)
    assert cache.take(HISTORY + [1, 2]) == Reuse("short", 20)  # "long" was taken
    cache.keep("again", HISTORY[:20])
    assert cache.take(HISTORY[:20]) == Reuse("again", 19)
    assert len(cache) == 0


def test_a_prompt_sharing_too_little_or_nothing_starts_afresh():
    cache = PrefixCache()
    cache.keep("a", HISTORY)
    assert cache.take(HISTORY[: MIN_REUSE - 1] + [1, 2, 3]) is None
    assert cache.take([5] + HISTORY) is None
    assert len(cache) == 1


def test_the_least_recently_kept_goes_first_by_count_and_by_room():
    cache = PrefixCache(most=2)
    assert cache.keep("a", HISTORY[:20]) == []
    assert cache.keep("b", HISTORY[:25]) == []
    assert cache.keep("c", HISTORY[:30]) == ["a"]
    assert cache.tokens == 55
    assert cache.within(40) == ["b"]
    assert cache.within(40) == [] and len(cache) == 1


def test_the_sequence_an_admitted_prompt_will_take_over_is_spared_and_not_counted():
    cache = PrefixCache()
    cache.keep("a", HISTORY[:20])
    cache.keep("b", [1] * 20)
    cache.keep("c", [2] * 20)
    assert cache.within(20, sparing=HISTORY) == ["b"]  # "a" spared; "c" fits in 20
    assert cache.within(0, sparing=HISTORY) == ["c"]
    assert cache.take(HISTORY) == Reuse("a", 20)
    assert cache.clear() == []
