"""The heartbeat MAC: keyed BLAKE2s written from RFC 7693, checked against the RFC and against hashlib."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import _native


def rfc_sequence(length: int, seed: int) -> bytes:
    """selftest_seq() of RFC 7693 Appendix E: a Fibonacci-like byte generator."""
    a, b, out = (0xDEAD4BAD * seed) & 0xFFFFFFFF, 1, bytearray()
    for _ in range(length):
        t = (a + b) & 0xFFFFFFFF
        a, b = b, t
        out.append(t >> 24)
    return bytes(out)


def test_rfc7693_self_test_grand_hash() -> None:
    """Appendix E: BLAKE2s-256 of every keyed and unkeyed digest over the RFC's lengths and sizes."""
    grand = hashlib.blake2s(digest_size=32)
    for outlen in (16, 20, 28, 32):
        for inlen in (0, 3, 64, 65, 255, 1024):
            data = rfc_sequence(inlen, inlen)
            grand.update(_native.blake2s(data, digest_size=outlen))
            grand.update(_native.blake2s(data, key=rfc_sequence(outlen, outlen), digest_size=outlen))
    assert grand.hexdigest() == "6a411f08ce25adcdfb02aba641451cec53c598b24f4fc787fbdc88797f4c1dfe"


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=700), key=st.binary(max_size=32), size=st.integers(1, 32))
def test_matches_hashlib(data: bytes, key: bytes, size: int) -> None:
    assert _native.blake2s(data, key=key, digest_size=size) == hashlib.blake2s(data, key=key,
                                                                             digest_size=size).digest()


def test_block_boundaries_match_hashlib() -> None:
    """The last block is compressed with the final flag: lengths around multiples of 64 are where that breaks."""
    key = bytes(range(32))
    for length in (0, 1, 63, 64, 65, 127, 128, 129, 192, 280):
        data = bytes(range(256)) * 2
        assert _native.blake2s(data[:length], key=key, digest_size=16) == hashlib.blake2s(
            data[:length], key=key, digest_size=16).digest(), length


def test_constant_time_compare() -> None:
    lib, ffi = _native.lib, _native.ffi
    a = bytes(16)
    assert lib.sx_equal_ct(a, a, 16) == 1
    for i in range(16):
        b = bytearray(16)
        b[i] = 0x80
        assert lib.sx_equal_ct(a, bytes(b), 16) == 0
    assert lib.sx_equal_ct(ffi.NULL, ffi.NULL, 0) == 1
