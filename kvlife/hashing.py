"""The page hash chain: one storage key per whole page, each the next page's prior.

The default scheme is SGLang HiCache's (``docs/design.md``, "Facts it builds on"), so a
decode side using kvlife finds the keys a prefill side wrote. A *namespace* seeds the chain
(:func:`namespace_prior`), so two models sharing a store never share keys; without one, keys
are exactly SGLang's. Any :class:`PageHasher` can replace the scheme.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

from kvlife.errors import HashingError

__all__ = ["PageHasher", "namespace_prior", "page_hashes", "sglang_page_hashes"]


class PageHasher(Protocol):
    """A hash-chain scheme: keys for whole pages of ``tokens``, chained from ``prior``."""

    def __call__(self, tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]: ...


def _check_pages(tokens: Sequence[int], page_size: int) -> None:
    if page_size <= 0:
        raise HashingError(f"page_size must be positive, got {page_size}")
    if len(tokens) % page_size:
        raise HashingError(
            f"{len(tokens)} tokens are not whole pages of {page_size}: "
            "partial pages have no storage key"
        )


@functools.lru_cache(maxsize=64)
def _packer(page_size: int) -> Callable[..., bytes]:
    """``struct`` packer of one page of token ids, 4 bytes little-endian unsigned each."""
    return struct.Struct(f"<{page_size}I").pack


def sglang_page_hashes(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
    """SGLang HiCache keys for the whole pages of ``tokens``, chained from ``prior``."""
    _check_pages(tokens, page_size)
    try:
        prior_bytes = bytes.fromhex(prior) if prior else b""
    except (TypeError, ValueError):
        raise HashingError(f"prior {prior!r} is not a hex digest") from None
    pack = _packer(page_size)
    sha256 = hashlib.sha256
    keys: list[str] = []
    for start in range(0, len(tokens), page_size):
        try:
            packed = pack(*tokens[start : start + page_size])
        except (struct.error, TypeError):
            raise HashingError(
                f"token ids of page {start // page_size} must be ints in [0, 2**32)"
            ) from None
        digest = sha256(prior_bytes + packed).digest()
        keys.append(digest.hex())
        prior_bytes = digest
    return keys


def namespace_prior(namespace: str) -> str:
    """The prior that seeds a chain in ``namespace`` (used when there is no prior)."""
    return hashlib.sha256(namespace.encode()).hexdigest()


def page_hashes(
    tokens: Sequence[int],
    page_size: int,
    prior: str | None = None,
    *,
    namespace: str | None = None,
    scheme: PageHasher = sglang_page_hashes,
) -> list[str]:
    """One key per whole page of ``tokens``, chained from ``prior`` (or the namespace seed).

    Partial pages are refused with :class:`~kvlife.errors.HashingError`.
    """
    if prior is None and namespace is not None:
        prior = namespace_prior(namespace)
    return scheme(tokens, page_size, prior)
