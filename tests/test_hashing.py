"""The page hash chain against an independent implementation of the SGLang HiCache key scheme.

The expected keys are built here from the scheme's description alone
(hashlib, one 4-byte little-endian unsigned word per token, prior digest bytes
first), sharing no code with :mod:`kvlife.hashing`. Literal digests pin the
scheme, so a change of scheme cannot pass silently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.errors import HashingError, KVLifeError
from kvlife.hashing import namespace_prior, page_hashes, sglang_page_hashes


def independent_keys(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
    """The scheme as described: sha256(prior bytes ++ each token as u32 LE), page by page."""
    keys: list[str] = []
    for start in range(0, len(tokens), page_size):
        digest = hashlib.sha256()
        digest.update(bytes.fromhex(prior) if prior else b"")
        for token in tokens[start : start + page_size]:
            digest.update(token.to_bytes(4, "little"))
        prior = digest.hexdigest()
        keys.append(prior)
    return keys


#: Computed once with independent_keys and pinned.
KEY_RANGE16_PAGE16 = "5d85718ec594b982c252d0279e5966ffca33a5eaf2a455038d3ab331fde70cea"
KEYS_TWO_PAGES_OF_4 = [
    "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
    "7e8cd3f4efd3f7467e73814edb0a512ba1251e26cc23390c695e138a8e99f9df",
]
TWO_PAGES_OF_4 = [1, 2, 3, 4, 2**32 - 1, 0, 7, 8]


def test_literal_known_answers() -> None:
    assert page_hashes(list(range(16)), 16) == [KEY_RANGE16_PAGE16]
    assert sglang_page_hashes(list(range(16)), 16, None) == [KEY_RANGE16_PAGE16]
    assert page_hashes(TWO_PAGES_OF_4, 4) == KEYS_TWO_PAGES_OF_4


def test_the_independent_scheme_gives_the_pinned_answers() -> None:
    assert independent_keys(list(range(16)), 16, None) == [KEY_RANGE16_PAGE16]
    assert independent_keys(TWO_PAGES_OF_4, 4, None) == KEYS_TWO_PAGES_OF_4


def test_the_chain_feeds_each_key_as_the_next_prior() -> None:
    first, second = KEYS_TWO_PAGES_OF_4
    assert page_hashes(TWO_PAGES_OF_4[4:], 4, prior=first) == [second]
    assert page_hashes(TWO_PAGES_OF_4[:4], 4) == [first]


def test_an_empty_prior_is_no_prior() -> None:
    assert page_hashes(TWO_PAGES_OF_4, 4, prior="") == KEYS_TWO_PAGES_OF_4


def test_token_bytes_are_little_endian_unsigned() -> None:
    # 1 as LE u32 is 01 00 00 00; big-endian would be 00 00 00 01.
    assert page_hashes([1], 1) == [hashlib.sha256(b"\x01\x00\x00\x00").hexdigest()]
    assert page_hashes([2**32 - 1], 1) == [hashlib.sha256(b"\xff" * 4).hexdigest()]


_tokens_strategy = st.integers(1, 4).flatmap(
    lambda page_size: st.tuples(
        st.just(page_size),
        st.integers(0, 4).flatmap(
            lambda pages: st.lists(
                st.integers(0, 2**32 - 1), min_size=pages * page_size, max_size=pages * page_size
            )
        ),
    )
)


@settings(max_examples=200, deadline=None)
@given(case=_tokens_strategy, prior=st.one_of(st.none(), st.binary(min_size=32, max_size=32)))
def test_keys_match_the_independent_scheme(
    case: tuple[int, list[int]], prior: bytes | None
) -> None:
    page_size, tokens = case
    prior_hex = prior.hex() if prior is not None else None
    expected = independent_keys(tokens, page_size, prior_hex)
    assert page_hashes(tokens, page_size, prior_hex) == expected
    assert sglang_page_hashes(tokens, page_size, prior_hex) == expected
    assert len(expected) == len(tokens) // page_size


@pytest.mark.parametrize("tokens", [[1], [1, 2, 3], [1, 2, 3, 4, 5]])
def test_partial_pages_are_refused(tokens: list[int]) -> None:
    with pytest.raises(HashingError, match="not whole pages"):
        page_hashes(tokens, 2)


@pytest.mark.parametrize("page_size", [0, -4])
def test_a_non_positive_page_size_is_refused(page_size: int) -> None:
    with pytest.raises(HashingError, match="page_size"):
        page_hashes([1, 2], page_size)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, 1.5, "7", None])
def test_token_ids_outside_u32_are_refused(bad: object) -> None:
    with pytest.raises(HashingError, match=r"\[0, 2\*\*32\)") as info:
        page_hashes([0, 1, 2, bad], 2)  # type: ignore[list-item]
    assert isinstance(info.value, KVLifeError)
    assert "page 1" in str(info.value)


def test_the_u32_edges_are_accepted() -> None:
    assert page_hashes([0, 2**32 - 1], 2) == independent_keys([0, 2**32 - 1], 2, None)


def test_a_prior_that_is_not_hex_is_refused() -> None:
    with pytest.raises(HashingError, match="not a hex digest"):
        page_hashes([1, 2], 2, prior="not-hex")


def test_no_tokens_give_no_keys() -> None:
    assert page_hashes([], 4) == []


def test_a_namespace_changes_the_keys_and_seeds_the_prior() -> None:
    plain = page_hashes(TWO_PAGES_OF_4, 4)
    spaced = page_hashes(TWO_PAGES_OF_4, 4, namespace="model-a")
    other = page_hashes(TWO_PAGES_OF_4, 4, namespace="model-b")
    assert len({*plain, *spaced, *other}) == 6
    seed = hashlib.sha256(b"model-a").hexdigest()
    assert namespace_prior("model-a") == seed
    assert spaced == page_hashes(TWO_PAGES_OF_4, 4, prior=namespace_prior("model-a"))
    assert spaced == independent_keys(TWO_PAGES_OF_4, 4, seed)


def test_an_explicit_prior_wins_over_the_namespace() -> None:
    prior = KEYS_TWO_PAGES_OF_4[0]
    assert page_hashes([5, 6], 2, prior, namespace="model-a") == page_hashes([5, 6], 2, prior)


def test_a_pluggable_scheme_is_called_with_tokens_page_size_and_prior() -> None:
    calls: list[tuple[list[int], int, str | None]] = []

    def scheme(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        calls.append((list(tokens), page_size, prior))
        return ["custom"] * (len(tokens) // page_size)

    assert page_hashes([1, 2, 3, 4], 2, "ab", scheme=scheme) == ["custom", "custom"]
    assert page_hashes([1, 2], 2, namespace="ns", scheme=scheme) == ["custom"]
    assert calls == [([1, 2, 3, 4], 2, "ab"), ([1, 2], 2, namespace_prior("ns"))]
