"""The failure detector (heartbeat.c, blake2s.c): authenticated UDP heartbeats and their events."""

from __future__ import annotations

import os
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for

HB_DROP_REASONS: tuple[str, ...] = tuple(ffi.string(lib.sx_hb_drop_name(i)).decode() for i in range(lib.SX_HB_NDROPS))


HB_STATES = {lib.SX_HB_UNKNOWN: "unknown", lib.SX_HB_HEALTHY: "healthy", lib.SX_HB_SUSPECTED: "suspected",
             lib.SX_HB_CONFIRMED: "confirmed"}


HB_EVENTS = {lib.SX_HB_EVENT_HEALTHY: "healthy", lib.SX_HB_EVENT_SUSPECTED: "suspected",
             lib.SX_HB_EVENT_CONFIRMED: "confirmed", lib.SX_HB_EVENT_RESTARTED: "restarted"}


HB_MODES = {lib.SX_HB_DIRECT: "direct", lib.SX_HB_GOSSIP: "gossip"}


HB_KEY_BYTES = lib.SX_HB_KEY_BYTES


HB_HEADER_BYTES = lib.SX_HB_HEADER_BYTES


HB_MAX_DATAGRAM = lib.SX_HB_MAX_DATAGRAM


_HB_PEER_FIELDS = ("addr", "port", "state_since_ns", "last_seen_ns", "last_alive_ns", "rtt_ns", "rtt_var_ns",
                   "probes_sent", "acks_received", "pings_received", "accepted", "suspicions", "instance",
                   "restarts", "incarnation")


_HB_STAT_FIELDS = ("port", "instance", "incarnation", "generation", "sent", "send_errors", "received", "accepted",
                   "relayed", "stalls", "events")


_EVENT_BATCH = 64


def blake2s(data: Any, *, key: bytes = b"", digest_size: int = 32) -> bytes:
    """Keyed BLAKE2s (RFC 7693) as the heartbeat computes it; the same bytes as hashlib.blake2s."""
    if not 1 <= digest_size <= 32 or len(key) > 32:
        raise ValueError(f"BLAKE2s takes a digest of 1-32 bytes and a key of at most 32, not {digest_size}/{len(key)}")
    buf = as_buffer(data)
    out = ffi.new("uint8_t[]", digest_size)
    raise_for(lib.sx_blake2s(out, digest_size, key, len(key), buf, len(buf)), "blake2s")
    return bytes(ffi.buffer(out, digest_size))


def _raise_elastic(code: int, what: str) -> None:
    if code == lib.SX_ENET:
        err = lib.sx_last_errno()
        raise errors.HeartbeatSocketError(err, f"{what}: {os.strerror(err) if err else 'socket error'}")
    if code == lib.SX_ETIMEDOUT:
        raise TimeoutError(what)
    raise_for(code, what)


class Heartbeat:
    """One heartbeat monitor in C (see sx_hb_* in sneppx.h): a bound UDP socket and, once started, its thread.

    peers: (IPv4 as int, port) pairs. Times are CLOCK_MONOTONIC nanoseconds. The memory is freed when the
    object is garbage; stop() ends the thread and frees the port at once.

    sock_fd: -1 to bind bind_addr:bind_port, else the descriptor of an IPv4 UDP socket the caller has bound
    and keeps: the monitor uses a dup of it and closes only that (bind_* are then taken from the socket).
    first_contact_grace_ns: a peer never heard from is suspected only timeout + this after start().
    """

    def __init__(self, *, bind_addr: int, bind_port: int, peers: list[tuple[int, int]], key: bytes, job_tag: bytes,
                 interval_ns: int, timeout_ns: int, probe_timeout_ns: int, suspicion_ns: int, direct_limit: int,
                 indirect_probes: int, retransmits: int, generation: int, first_contact_grace_ns: int = 0,
                 sock_fd: int = -1):
        if len(key) != HB_KEY_BYTES or len(job_tag) != 16:
            raise ValueError(f"the heartbeat key must be {HB_KEY_BYTES} bytes and the job tag 16")
        for name, value in (("interval_ns", interval_ns), ("timeout_ns", timeout_ns), ("retransmits", retransmits)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if first_contact_grace_ns < 0:
            raise ValueError(f"first_contact_grace_ns must not be negative, not {first_contact_grace_ns}")
        cfg = ffi.new("sx_hb_config *")
        cfg.bind_addr, cfg.bind_port = bind_addr, bind_port
        cfg.interval_ns, cfg.timeout_ns = interval_ns, timeout_ns
        cfg.probe_timeout_ns, cfg.suspicion_ns = probe_timeout_ns, suspicion_ns
        cfg.direct_limit, cfg.indirect_probes, cfg.retransmits = direct_limit, indirect_probes, retransmits
        cfg.generation = generation
        cfg.first_contact_grace_ns, cfg.sock_fd = first_contact_grace_ns, sock_fd
        ffi.memmove(cfg.key, key, len(key))
        ffi.memmove(cfg.job_tag, job_tag, 16)
        self.npeers = len(peers)
        addrs = ffi.new("uint32_t[]", [a for a, _ in peers] or [0])
        ports = ffi.new("uint16_t[]", [p for _, p in peers] or [0])
        out = ffi.new("sx_hb **")
        code = lib.sx_hb_create(cfg, addrs, ports, len(peers), out)
        ffi.memmove(cfg.key, bytes(len(key)), len(key))
        _raise_elastic(code, "heartbeat socket")
        self._hb = ffi.gc(out[0], lib.sx_hb_destroy)

    def start(self) -> None:
        _raise_elastic(lib.sx_hb_start(self._hb), "start heartbeat")

    def stop(self) -> None:
        lib.sx_hb_stop(self._hb)

    def set_generation(self, generation: int) -> None:
        _raise_elastic(lib.sx_hb_set_generation(self._hb, generation), f"set heartbeat generation {generation}")

    def stats(self) -> dict[str, Any]:
        """Counters of the whole monitor; `drops` by reason name, `mode` "direct" or "gossip"."""
        out = ffi.new("sx_hb_stats *")
        raise_for(lib.sx_hb_get_stats(self._hb, out), "heartbeat stats")
        stats: dict[str, Any] = {name: int(getattr(out, name)) for name in _HB_STAT_FIELDS}
        stats["mode"] = HB_MODES[out.mode]
        stats["drops"] = {name: int(out.drops[i]) for i, name in enumerate(HB_DROP_REASONS)}
        return stats

    def peers(self) -> list[dict[str, Any]]:
        """Every peer's state and counters, in the order given, from one consistent snapshot."""
        out = ffi.new("sx_hb_peer[]", max(1, self.npeers))
        raise_for(lib.sx_hb_get_peers(self._hb, out, self.npeers), "heartbeat peers")
        rows = []
        for i in range(self.npeers):
            row: dict[str, Any] = {name: int(getattr(out[i], name)) for name in _HB_PEER_FIELDS}
            row["state"] = HB_STATES[out[i].state]
            rows.append(row)
        return rows

    def wait_events(self, after: int, timeout: float | None) -> list[dict[str, Any]]:
        """Events with index > after (waits up to timeout seconds for the first; None = forever). [] on a timeout
        or once stopped."""
        out = ffi.new("sx_hb_event[]", _EVENT_BATCH)
        count = ffi.new("size_t *")
        timeout_ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        code = lib.sx_hb_wait_events(self._hb, after, out, _EVENT_BATCH, timeout_ns, count)
        if code in (lib.SX_ETIMEDOUT, lib.SX_ESTATE):
            return []
        raise_for(code, "heartbeat events")
        return [{"index": int(e.index), "kind": HB_EVENTS[e.kind], "peer": int(e.peer), "time_ns": int(e.time_ns),
                 "generation": int(e.generation)} for e in (out[i] for i in range(count[0]))]
