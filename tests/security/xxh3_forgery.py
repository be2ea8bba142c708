"""A forgery of XXH3, as an attacker would make one: a 1 KiB block of chosen bytes that leaves
the hash state as the true block left it, so every XXH3 digest over the data (the 64-bit chunk
digest and the 128-bit whole-blob digest) stays the same.

XXH3 adds each 64-byte stripe of a 1,024-byte block into eight 64-bit lanes: lane ``i`` gains
the stripe's word ``i ^ 1`` and the product of the low and high halves of word ``i`` XORed
with the secret. The first 14 stripes are the attacker's; the last two are solved lane pair
by lane pair so that every lane ends where the true block left it."""

from __future__ import annotations

import random
import struct

__all__ = ["BLOCK", "forge_block"]

BLOCK = 1024
# XXH3's default secret (xxhash.h, XXH3_kSecret), public and fixed.
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_FREE = 14 * 64


def _key(stripe: int, word: int) -> int:
    value: int = struct.unpack_from("<Q", _SECRET, 8 * stripe + 8 * word)[0]
    return value


def _mul(x: int) -> int:
    return (x & _M32) * (x >> 32)


def _lanes(block: bytes | bytearray, stripes: range) -> list[int]:
    lanes = [0] * 8
    for s in stripes:
        words = struct.unpack_from("<8Q", block, 64 * s)
        for i, w in enumerate(words):
            lanes[i ^ 1] = (lanes[i ^ 1] + w) & _M64
            lanes[i] = (lanes[i] + _mul(w ^ _key(s, i))) & _M64
    return lanes


def forge_block(true_block: bytes, chosen: bytes, seed: int = 0) -> bytes:
    """A block of ``BLOCK`` bytes starting with ``chosen`` (at most 832 bytes) that XXH3 cannot
    tell from ``true_block`` when it is a whole block of a long input (not the last one)."""
    assert len(true_block) == BLOCK and len(chosen) <= _FREE - 64
    target = _lanes(true_block, range(16))
    rng = random.Random(seed)
    for _ in range(10_000):
        # The 14th stripe is filler, drawn again until every lane pair is solvable (the
        # multiplier below must be odd: one try in 16 succeeds).
        block = bytearray(chosen.ljust(_FREE - 64, b"\0")) + rng.randbytes(64) + bytes(128)
        have = _lanes(block, range(14))
        need = [(target[i] - have[i]) & _M64 for i in range(8)]
        w14, w15 = [0] * 8, [0] * 8
        for i in range(0, 8, 2):
            j = i + 1
            # Word j of both stripes and word i of the last make no product (their low half
            # equals the secret's): lane j then only sums words, and lane i keeps one product.
            e = _key(15, j)
            lo_a = (need[j] - _key(15, i)) & _M32
            m = lo_a ^ (_key(14, i) & _M32)
            if m % 2 == 0:
                break
            t = (need[i] - e - _key(14, j)) & _M32
            n = (t * pow(m, -1, 1 << 32)) & _M32
            a = (((n ^ (_key(14, i) >> 32)) & _M32) << 32) | lo_a
            c = (need[j] - a) & _M64
            b = (need[i] - e - _mul(a ^ _key(14, i))) & _M64
            w14[i], w14[j], w15[i], w15[j] = a, b, c, e
        else:
            block[_FREE:_FREE + 64] = struct.pack("<8Q", *w14)
            block[_FREE + 64:] = struct.pack("<8Q", *w15)
            assert _lanes(block, range(16)) == target
            return bytes(block)
    raise AssertionError("no forgery found")
