"""The heartbeat datagram in Python: the reference for docs/ELASTIC.md's wire format.

The monitor itself encodes and checks datagrams in C (native/src/heartbeat.c); this module writes and reads
the same bytes with hashlib's BLAKE2s, independently of that code. Tests use it to check the C side against
the spec and to craft hostile datagrams; the benchmark uses it to play many simulated peers; anyone writing a
compatible peer can read it as the spec's executable form. Nothing in the runtime's own path imports it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct

from SneppX_ALG import _native

MAGIC = b"SXHB"
VERSION = 1
PING, ACK, PING_REQ = 1, 2, 3
FLAG_RELAYED = 1
HEALTHY, SUSPECTED, CONFIRMED = 1, 2, 3
HEADER = struct.Struct("<4sBBBB16sQQQQQQQQ")  # magic .. target: 88 bytes
ENTRY = struct.Struct("<QQII")                 # member id, incarnation, state, reserved
MAC_BYTES = 16
MAX_ENTRIES = 8
MAX_DATAGRAM = HEADER.size + MAX_ENTRIES * ENTRY.size + MAC_BYTES
assert HEADER.size == _native.HB_HEADER_BYTES and MAX_DATAGRAM == _native.HB_MAX_DATAGRAM  # the C side agrees


def member_id(addr: int, port: int) -> int:
    """How members name each other on the wire: the IPv4 address (as an int) shifted left 16, or the port."""
    return addr << 16 | port


@dataclasses.dataclass(frozen=True)
class Datagram:
    type: int
    job_tag: bytes
    instance: int
    generation: int
    seq: int
    send_time: int = 0
    probe_seq: int = 0
    probe_time: int = 0
    target: int = 0
    incarnation: int = 0
    flags: int = 0
    entries: tuple[tuple[int, int, int], ...] = ()  # (member id, incarnation, state)
    version: int = VERSION


def mac(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2s(body, key=key, digest_size=MAC_BYTES).digest()


def encode(d: Datagram, key: bytes) -> bytes:
    """The datagram's bytes, MAC included (key: the 32-byte MAC key, see job_key.load_key)."""
    body = HEADER.pack(MAGIC, d.version, d.type, len(d.entries), d.flags, d.job_tag, d.instance, d.incarnation,
                       d.generation, d.seq, d.send_time, d.probe_seq, d.probe_time, d.target)
    body += b"".join(ENTRY.pack(i, inc, state, 0) for i, inc, state in d.entries)
    return body + mac(key, body)


def decode(raw: bytes, key: bytes) -> Datagram:
    """Parses and authenticates a datagram; ValueError if it is malformed or its MAC is wrong."""
    if len(raw) < HEADER.size + MAC_BYTES or len(raw) > MAX_DATAGRAM:
        raise ValueError(f"a heartbeat datagram is {HEADER.size + MAC_BYTES}-{MAX_DATAGRAM} bytes, not {len(raw)}")
    (magic, version, kind, count, flags, tag, instance, incarnation, generation, seq, send_time, probe_seq,
     probe_time, target) = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or count > MAX_ENTRIES:
        raise ValueError("not a version-1 heartbeat datagram")
    end = HEADER.size + count * ENTRY.size
    if len(raw) != end + MAC_BYTES:
        raise ValueError(f"length {len(raw)} does not match {count} entries")
    if not hmac.compare_digest(mac(key, raw[:end]), raw[end:]):
        raise ValueError("bad MAC")
    entries = tuple(ENTRY.unpack_from(raw, HEADER.size + k * ENTRY.size)[:3] for k in range(count))
    return Datagram(kind, tag, instance, generation, seq, send_time, probe_seq, probe_time, target, incarnation,
                    flags, entries, version)
