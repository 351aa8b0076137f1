"""Stop strings over text that arrives in pieces (peerd/inference/stops.py)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerd.inference.stops import StopStrings

# A small alphabet, so stop strings and their prefixes turn up often in the text.
TEXT = st.text(alphabet="abc\n", max_size=12)
PIECES = st.lists(TEXT, max_size=12)
STOPS = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=4)


def _expected(pieces: list[str], stops: list[str]) -> str:
    """The text as the answer ends it: after the first piece that completes a stop string,
    before the earliest stop string in the text so far (all of it where none appears). A
    longer stop string that began earlier but would complete later never does: the answer
    has ended."""
    text = ""
    for piece in pieces:
        text += piece
        found = [text.find(stop) for stop in stops if stop in text]
        if found:
            return text[: min(found)]
    return text


def test_a_stop_string_completed_first_ends_the_text_before_a_longer_one_can():
    filter_ = StopStrings(["a", "baaa"])
    assert [filter_.add(p) for p in ("b", "aa", "a")] == ["", "b", ""]
    assert filter_.stopped and filter_.text == "b" == _expected(["b", "aa", "a"], ["a", "baaa"])


@given(PIECES, STOPS)
def test_the_text_handed_out_ends_before_the_first_stop_string(pieces, stops):
    filter_ = StopStrings(stops)
    handed_out = ""
    for piece in pieces:
        handed_out += filter_.add(piece)
    if not filter_.stopped:
        handed_out += filter_.end()
    full = "".join(pieces)
    assert handed_out == filter_.text == _expected(pieces, stops)
    assert filter_.stopped == any(stop in full for stop in stops)


@given(PIECES, STOPS)
def test_nothing_handed_out_is_taken_back_and_only_the_start_of_a_stop_string_waits(pieces,
                                                                                    stops):
    filter_ = StopStrings(stops)
    final = _expected(pieces, stops)
    so_far = ""
    for piece in pieces:
        filter_.add(piece)
        so_far += piece
        assert final.startswith(filter_.text), "never more than the final text"
        waiting = "" if filter_.stopped else so_far[len(filter_.text):]
        assert waiting == "" or any(stop.startswith(waiting) for stop in stops), (
            "held back only while it may begin a stop string")


def test_a_stop_string_split_over_pieces_is_held_back_then_dropped():
    filter_ = StopStrings(["\nUser:"])
    assert [filter_.add(p) for p in ["Hi", " there\nU", "se", "r: more"]] == ["Hi", " there",
                                                                             "", ""]
    assert filter_.stopped and filter_.text == "Hi there"


def test_a_held_back_start_that_turns_out_not_to_be_a_stop_string_is_handed_out():
    filter_ = StopStrings(["###"])
    assert filter_.add("a#") == "a"
    assert filter_.add("#b") == "##b"
    assert filter_.add("##") == ""
    assert filter_.end() == "##" and not filter_.stopped


def test_without_stop_strings_every_piece_passes_at_once():
    filter_ = StopStrings([])
    assert [filter_.add(p) for p in ["a", "b"]] == ["a", "b"] and filter_.end() == ""


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        StopStrings(["x", ""])
