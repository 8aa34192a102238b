"""Page keys: the key contract, key ids, and chained prefix hashes inside a namespace.

Owns what a key is and how it is derived from token ids. It must never look at tiers or
page contents.

The key contract (checked at every API entry, before any state changes):
- a key is a `str` or a `bytes` object (subclasses included), non-empty;
- `"abc"` and `b"abc"` are two different keys, in every tier;
- inside kvtier every key is known by its *id*: 16 bytes of keyed BLAKE2b over the key, with
  the key's type in the personalization, so ids of distinct keys never collide in practice
  (2**-128 a pair) and a str never aliases the bytes of its encoding. The device and host
  page tables and the remote store all index pages by id; the remote store's record headers
  carry it, which is what lets a store's index be rebuilt from its segment files.

Prefix keys (key scheme 3): key_i = BLAKE2s-256(key_{i-1} || tokens of page i) as 32 raw
bytes, with key_{-1} = the namespace digest, so every key already depends on the model, the
page format fingerprint, the rank and the key scheme. Token bytes are the ids as little-endian
uint32. Page size 1 (SGLang's default) is bound by one hash call a token: BLAKE2s costs about
0.4 µs a call where SHA-256 (scheme 2, same layout) cost 0.55-0.6 on CPUs without SHA
instructions. Scheme 1 was scheme 2's chain as hex strings. The scheme is in the namespace
digest, so keys of an older scheme miss rather than alias.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.index import native

KEY_SCHEME = 3
KEY_ID_BYTES = 16

_STR_ID = hashlib.blake2b(digest_size=KEY_ID_BYTES, person=b"kvtier-key-str")
_BYTES_ID = hashlib.blake2b(digest_size=KEY_ID_BYTES, person=b"kvtier-key-bytes")


def _describe(key: object) -> str:
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


def key_id(key: str | bytes) -> bytes:
    """The 16-byte id of one key; TypeError (naming the key) for anything but non-empty str or bytes."""
    if isinstance(key, bytes):
        if not key:
            raise ValueError("a key must not be empty, got b''")
        h = _BYTES_ID.copy()
        h.update(key)
        return h.digest()
    if isinstance(key, str):
        if not key:
            raise ValueError("a key must not be empty, got ''")
        h = _STR_ID.copy()
        h.update(key.encode("utf-8", "surrogatepass"))
        return h.digest()
    raise TypeError(f"a key must be str or bytes, got {type(key).__name__} {_describe(key)}")


# Ids of recently seen keys, in two generations: an engine asks about the same keys again and
# again (a `match`, then a `load` of its prefix, then a `load` every step), and a dict lookup
# costs a tenth of a BLAKE2b call. A key reaches the young generation when hashed or found in
# the old one; a full young generation becomes the old one, so between GENERATION and twice that
# many recent keys stay known, and nothing else. The cache is bounded by size as well as by
# count: a generation also turns over once its keys hold ID_CACHE_GENERATION_CHARS characters
# (or bytes), and keys longer than ID_CACHE_MAX_KEY are never cached (hashing one costs more
# than the lookup saves anyway), so whatever keys an engine sends, the cache keeps the keys it
# holds alive up to 2 * ID_CACHE_GENERATION_CHARS characters (16 MiB of UCS-4 text at most).
# A key id is a pure function of the key (a str and a bytes object are never equal as dict
# keys), so a race between threads can only drop an entry, never give a wrong id.
ID_CACHE_GENERATION = 1 << 15
ID_CACHE_GENERATION_CHARS = 1 << 21
ID_CACHE_MAX_KEY = 1 << 12
# New keys are hashed and cached in one pass from this many keys a batch (below it, one at a
# time costs no more), or from _FILL_BATCH_C keys where the C paths hash them.
_FILL_BATCH = 32
_FILL_BATCH_C = 8
_young: dict = {}
_old: dict = {}
_PLAIN = {bytes, str}
_young_chars = 0


def clear_id_cache() -> None:
    """Forget every cached key id."""
    global _young, _old, _young_chars
    _young, _old, _young_chars = {}, {}, 0


# Pools hold the cache while they are open; when the last one closes its keys are let go.
_holders = 0
_holders_lock = threading.Lock()


def hold_id_cache() -> None:
    """A pool opened: the cache serves it until ``release_id_cache``."""
    global _holders
    with _holders_lock:
        _holders += 1


def release_id_cache() -> None:
    """A pool closed; the last one to close empties the cache (keys of any size it kept)."""
    global _holders
    with _holders_lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            clear_id_cache()


def key_ids(keys: Iterable[str | bytes], first: int = 0) -> list[bytes]:
    """Ids of a batch of keys, in order. Checks every key before returning anything.

    Raises TypeError / ValueError naming the first bad key and its position (counted from
    `first`: the position of `keys[0]` in the caller's whole batch).
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a sequence of keys, got a single {type(keys).__name__} {_describe(keys)}")
    if type(keys) is not list and type(keys) is not tuple:
        keys = list(keys)
    lib = native.module()
    if lib is not None:  # the same steps in C: the cached ids, then the others in one pass
        found = lib.known(keys, _young)
        if found is not None:
            out, missing = found
            if not missing or len(out) >= _FILL_BATCH_C and _fill_new(keys, out):
                return out
        return _key_ids_each(keys, first)
    # A batch of plain, non-empty keys: the ids seen just now (a load after its match, a
    # step after the last) read from the young generation, the others found or hashed in one
    # pass and cached in one update.
    try:
        out = list(map(_young.get, keys))
    except TypeError:  # an unhashable key: the loop names it
        return _key_ids_each(keys, first)
    if None not in out:  # (only non-empty keys are ever cached)
        if set(map(type, keys)) <= _PLAIN:
            return out
    elif len(out) >= _FILL_BATCH and set(map(type, keys)) <= _PLAIN and all(keys) and _fill_new(keys, out):
        return out
    return _key_ids_each(keys, first)


def plain_distinct(keys: list | tuple) -> bool:
    """Whether `keys` are non-empty plain `str` / `bytes` objects (no subclass) with no repeat:
    then `key_ids` cannot fail on them and their ids do not repeat, so a caller may hash them
    later, a part at a time. False says nothing more: `key_ids` and a repeat check name the fault."""
    return set(map(type, keys)) <= _PLAIN and all(keys) and len(set(keys)) == len(keys)


def _fill_new(keys: list, out: list) -> bool:
    """Fill in the ids `out` lacks (None) of plain non-empty `keys`: from the old generation, else
    hashed; all of them cached in the young generation at once. False, with nothing changed,
    when they would turn the generation over or a key is too long to cache (the loop does
    those one at a time)."""
    global _young_chars
    lib = native.module()
    if lib is not None:  # the same pass in C (native/host_index.c)
        chars = lib.fill(keys, out, _young, _old, ID_CACHE_MAX_KEY, ID_CACHE_GENERATION - len(_young),
                         ID_CACHE_GENERATION_CHARS - _young_chars)
        if chars is None:
            return False
        _young_chars += chars
        return True
    if out.count(None) == len(out):  # every key new (a commit): no positions to keep
        at, new = None, keys
    else:
        at = [i for i, kid in enumerate(out) if kid is None]
        new = [keys[i] for i in at]
    young = _young
    chars = sum(map(len, new))
    if (max(map(len, new)) > ID_CACHE_MAX_KEY or len(young) + len(new) >= ID_CACHE_GENERATION
            or _young_chars + chars >= ID_CACHE_GENERATION_CHARS):
        return False
    ids = list(map(_old.get, new))
    if None in ids:
        bytes_id, str_id = _BYTES_ID.copy, _STR_ID.copy
        for j, kid in enumerate(ids):
            if kid is None:
                key = new[j]
                if type(key) is bytes:
                    h = bytes_id()
                    h.update(key)
                else:
                    h = str_id()
                    h.update(key.encode("utf-8", "surrogatepass"))
                ids[j] = h.digest()
    young.update(zip(new, ids))
    _young_chars += chars
    if at is None:
        out[:] = ids
    else:
        for i, kid in zip(at, ids):
            out[i] = kid
    return True


def _key_ids_each(keys, first: int = 0) -> list[bytes]:
    """`key_ids` one key at a time: names a bad key, and turns the cache's generations over."""
    global _young, _old, _young_chars
    out = []
    append = out.append
    str_id, bytes_id = _STR_ID, _BYTES_ID
    young, old = _young, _old
    young_get, old_get = young.get, old.get
    for i, key in enumerate(keys):
        kind = type(key)
        # The common cases inline: a batch of thousands of keys is looked up on every call.
        if (kind is bytes or kind is str) and key:
            kid = young_get(key)
            if kid is not None:
                append(kid)
                continue
            size = len(key)
            kid = old_get(key) if size <= ID_CACHE_MAX_KEY else None
            if kid is None:
                if kind is bytes:
                    h = bytes_id.copy()
                    h.update(key)
                else:
                    h = str_id.copy()
                    h.update(key.encode("utf-8", "surrogatepass"))
                kid = h.digest()
            append(kid)
            if size > ID_CACHE_MAX_KEY:
                continue
            young[key] = kid
            _young_chars += size
            if len(young) >= ID_CACHE_GENERATION or _young_chars >= ID_CACHE_GENERATION_CHARS:
                if young is _young:  # else another thread turned it over already
                    _young, _old, _young_chars = {}, young, 0
                young, old = _young, _old
                young_get, old_get = young.get, old.get
            continue
        try:
            append(key_id(key))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"key {first + i}: {exc}") from None
    return out


@dataclass(frozen=True)
class Namespace:
    """Where a page's bytes are valid: one model, one page format, one rank."""

    model: str
    fingerprint: str
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"Namespace.model must be a non-empty model id, got {self.model!r}")
        if not isinstance(self.fingerprint, str) or len(self.fingerprint) != 64:
            raise ValueError(
                f"Namespace.fingerprint must be a 64-char sha256 hex digest (PageFormat.fingerprint), got {self.fingerprint!r}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"Namespace.rank must be an int >= 0, got {self.rank!r}")

    @property
    def digest(self) -> str:
        text = f"kvtier-ns|keys={KEY_SCHEME}|model={self.model}|format={self.fingerprint}|rank={self.rank}"
        return hashlib.sha256(text.encode()).hexdigest()


def prefix_keys(token_ids: Iterable[int] | np.ndarray, page_size: int, namespace: Namespace, prior: bytes | None = None) -> list[bytes]:
    """Keys (32 raw bytes each) of the full pages of `token_ids`; a trailing partial page gets no key.

    `prior` continues a chain: the key of the page just before `token_ids[0]`.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be an int > 0, got {page_size!r}")
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a kvtier Namespace (pool.namespace), got {type(namespace).__name__}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**32):
        raise ValueError(f"token ids must lie in [0, 2**32), got range [{tokens.min()}, {tokens.max()}]")
    if prior is None:
        start = bytes.fromhex(namespace.digest)
    elif isinstance(prior, bytes) and len(prior) == 32:
        start = prior
    else:
        raise ValueError(f"prior must be a 32-byte key from prefix_keys, got {_describe(prior)}")
    full = len(tokens) // page_size * page_size
    if not full:
        return []
    # One void element per page gives each page's bytes as a bytes object, no slicing loop.
    pages = np.ascontiguousarray(tokens[:full], dtype="<u4").view(f"V{4 * page_size}").tolist()
    blake2s = hashlib.blake2s
    keys = list(itertools.accumulate(pages, lambda prev, page: blake2s(prev + page).digest(), initial=start))
    del keys[0]
    return keys
