"""Record format of the remote store: the 64-byte header, checksums, the optional MAC, tokens.

Owns what a record says about itself and how that is checked: the header layout, the payload
CRC32C, the keyed BLAKE2b MAC when the store has a key, and the write tokens. It must never do
I/O: callers hand it bytes or pointers to host memory.

Record header, format version 3 (64 bytes, little endian)::

    magic "KVTP" | version u16 | flags u16 | namespace fingerprint or MAC (16) | key id (16)
    | payload length u64 | write token u64 | payload CRC32C u32 | CRC32C of the 60 bytes before

The key id is ``kvtier.index.keys.key_id(key)``, the id the index stores, so the index can be
rebuilt from the headers. The namespace fingerprint is BLAKE2b-128 of the namespace hex.
Version 2 headed the same fields with a digest of the key's UTF-8 bytes (``"k"`` and ``b"k"``
were one key) and is not read any more.

Integrity, not authenticity: CRC32C finds torn writes and flipped bits, but anyone who can
write the files can also write a matching CRC32C. With a ``mac_key``, flag bit 0 is set and the
16-byte namespace field holds a keyed BLAKE2b-128 over the key id, length, token, payload and
namespace fingerprint (the namespace last, so a rebuild can try each known namespace without
hashing the payload again). The MAC is checked on every read; a record written without the
key, or with another key, is a miss. The MAC covers the namespace, so a record cannot move
between namespaces either.

Write tokens are 63 bits: milliseconds since the epoch above 20 random bits. They tell two
writes of one key apart (a reader that raced a rewrite sees another token) and order them,
so a rebuild keeps the newest record of each key.
"""

from __future__ import annotations

import hashlib
import random
import struct
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvtier.tiers.remote.errors import RemoteUnavailable

try:
    import crc32c  # hardware CRC32C: about 15 GB/s a core against zlib crc32's 2.3
except ImportError:  # reported when a store is opened, like a missing NIXL
    crc32c = None

MAGIC = b"KVTP"
FORMAT_VERSION = 3
HEADER_BYTES = 64
SLOT_ALIGN = 4096
FLAG_MAC = 1
MAC_KEY_MIN_BYTES = 16
CRC32C_INSTALL_HINT = "pip install crc32c"
_HEADER_BODY = struct.Struct("<4sHH16s16sQQI")
_HEADER_CRC = struct.Struct("<I")
_MAC_PERSON = b"kvtier-page-mac"
_TOKEN_RANDOM_BITS = 20


def require_crc32c() -> None:
    if crc32c is None:
        raise RemoteUnavailable(
            f"the remote tier checks pages with crc32c, which is not installed; install it "
            f"with: {CRC32C_INSTALL_HINT}"
        )


def namespace_fingerprint(namespace: str) -> bytes:
    """16-byte fingerprint of a namespace hex string, as stored in headers and the index."""
    return hashlib.blake2b(b"kvtier-namespace:" + namespace.encode(), digest_size=16).digest()


def new_tokens(count: int) -> list[int]:
    """Write tokens, ordered by time across processes of one host (see the module docstring)."""
    now = (time.time_ns() // 1_000_000) << _TOKEN_RANDOM_BITS
    return [(now | random.getrandbits(_TOKEN_RANDOM_BITS)) & ((1 << 63) - 1) for _ in range(count)]


@dataclass(frozen=True)
class Header:
    """A parsed record header (fields as written; nothing verified but the header CRC)."""

    version: int
    flags: int
    namespace_or_mac: bytes
    key_id: bytes
    length: int
    token: int
    crc: int


def parse_header(raw: bytes) -> Optional[Header]:
    """The header in ``raw`` (64 bytes), or None if its magic or header CRC32C is wrong."""
    if len(raw) != HEADER_BYTES or raw[:4] != MAGIC:
        return None
    body = raw[: _HEADER_BODY.size]
    (check,) = _HEADER_CRC.unpack_from(raw, _HEADER_BODY.size)
    if crc32c.crc32c(body) != check:
        return None
    _, version, flags, ns, key, length, token, crc = _HEADER_BODY.unpack(body)
    return Header(version, flags, ns, key, length, token, crc)


def payload_crc(views: Sequence) -> int:
    """CRC32C of the concatenation of ``views`` (buffer-protocol objects), in order."""
    crc = 0
    for view in views:
        crc = crc32c.crc32c(view, crc)
    return crc


class RecordCodec:
    """Builds and checks the headers of one namespace, with or without a MAC key."""

    def __init__(self, namespace_fp: bytes, mac_key: Optional[bytes]):
        if mac_key is not None:
            if not isinstance(mac_key, bytes) or not MAC_KEY_MIN_BYTES <= len(mac_key) <= 64:
                raise ValueError(
                    f"mac_key of {len(mac_key) if isinstance(mac_key, bytes) else type(mac_key).__name__}"
                    f"{' bytes' if isinstance(mac_key, bytes) else ''}; expected bytes of "
                    f"{MAC_KEY_MIN_BYTES} to 64 bytes (BLAKE2b key)"
                )
        self.namespace_fp = namespace_fp
        self.mac_key = mac_key
        self.flags = FLAG_MAC if mac_key is not None else 0

    def mac(self, key_id: bytes, length: int, token: int, views: Sequence) -> bytes:
        h = hashlib.blake2b(key=self.mac_key, digest_size=16, person=_MAC_PERSON)
        h.update(key_id + struct.pack("<QQ", length, token))
        for view in views:
            h.update(view)
        h.update(self.namespace_fp)
        return h.digest()

    def header(self, key_id: bytes, length: int, token: int, crc: int, tag: Optional[bytes]) -> bytes:
        """The header a record must carry; ``tag`` is the MAC when the codec has a key."""
        body = _HEADER_BODY.pack(
            MAGIC, FORMAT_VERSION, self.flags, self.namespace_fp if tag is None else tag,
            key_id, length, token, crc,
        )
        return body + _HEADER_CRC.pack(crc32c.crc32c(body))

    def seal(self, key_id: bytes, length: int, token: int, views: Sequence) -> tuple[int, bytes]:
        """(payload CRC32C, header) of a record about to be written."""
        crc = payload_crc(views)
        tag = self.mac(key_id, length, token, views) if self.mac_key is not None else None
        return crc, self.header(key_id, length, token, crc, tag)

    def verify(
        self, key_id: bytes, length: int, token: int, crc: int, got_header: bytes, views: Sequence
    ) -> bool:
        """Whether a record just read is the one the index promises: header and payload."""
        if payload_crc(views) != crc:
            return False
        tag = self.mac(key_id, length, token, views) if self.mac_key is not None else None
        return got_header == self.header(key_id, length, token, crc, tag)


def headers_array(headers: Sequence[bytes]) -> np.ndarray:
    """Headers packed into a writable (n, 64) uint8 array that NIXL can read from."""
    packed = bytearray(b"".join(headers))
    return np.frombuffer(packed, dtype=np.uint8).reshape(len(headers), HEADER_BYTES)
