"""Text edits of the robustness study: sizes and provenance of what they change."""

from __future__ import annotations

import random

from benchmarks.evaluation.attacks import copy_paste, delete_words, substitute_tokens


def test_copy_paste_replaces_one_contiguous_span_from_the_source() -> None:
    own = list(range(100, 200))
    source = list(range(1000, 1100))
    for fraction in (0.1, 0.3, 0.5):
        mixed = copy_paste(own, source, fraction, random.Random(3))
        assert len(mixed) == len(own)
        replaced = [i for i, (a, b) in enumerate(zip(mixed, own, strict=True)) if a != b]
        assert len(replaced) == round(fraction * len(own))
        assert replaced == list(range(replaced[0], replaced[0] + len(replaced)))  # contiguous
        assert all(mixed[i] == source[i] for i in replaced)  # same positions of the source


def test_copy_paste_of_nothing_is_the_identity() -> None:
    assert copy_paste([1, 2, 3], [4, 5, 6], 0.0, random.Random(0)) == [1, 2, 3]


def test_delete_words_removes_the_requested_share() -> None:
    text = " ".join(f"w{i}" for i in range(50))
    out = delete_words(text, 0.2, random.Random(1)).split()
    assert len(out) == 40
    assert set(out) <= set(text.split())
    assert out == [w for w in text.split() if w in set(out)]  # order kept


def test_substitute_tokens_changes_the_requested_share_within_the_range() -> None:
    own = [5] * 200
    out = substitute_tokens(own, 0.3, 17, 49152, random.Random(2))
    changed = [t for t in out if t != 5]
    assert len(out) == 200
    assert len(changed) == 60  # a random id never equals 5: the range starts at 17
    assert all(17 <= t < 49152 for t in changed)
