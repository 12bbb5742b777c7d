"""HeartbeatMonitor's configuration: where the key comes from, what it binds, whom it watches."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

from SneppX_ALG import HeartbeatMonitor, errors, job_key
from SneppX_ALG.contract.env import ENV_HEARTBEAT_BIND, ENV_HEARTBEAT_KEY, ENV_HEARTBEAT_KEY_FILE
from SneppX_ALG.elastic import heartbeat

KEY = bytes(range(32))


def test_no_key_anywhere_names_both_variables() -> None:
    with pytest.raises(errors.HeartbeatKeyError) as caught:
        HeartbeatMonitor(peers=["127.0.0.1:29501"], environ={})
    assert "SNEPPX_HEARTBEAT_KEY_FILE" in str(caught.value) and "SNEPPX_HEARTBEAT_KEY" in str(caught.value)


def test_key_sources_in_order(tmp_path: pathlib.Path) -> None:
    key_file = tmp_path / "heartbeat-key"
    key_file.write_bytes(b"\x01" * 32)  # raw bytes, as the operator mounts the Secret
    env = {ENV_HEARTBEAT_KEY_FILE: str(key_file), ENV_HEARTBEAT_KEY: "02" * 32}
    assert job_key.load_key(b"\x03" * 32, env) == b"\x03" * 32
    assert job_key.load_key("04" * 32, env) == b"\x04" * 32
    assert job_key.load_key(None, env) == b"\x01" * 32
    assert job_key.load_key(None, {ENV_HEARTBEAT_KEY: "02" * 32}) == b"\x02" * 32


def test_keys_other_than_32_bytes_are_hashed_and_short_ones_refused(tmp_path: pathlib.Path) -> None:
    assert job_key.load_key(b"k" * 16, {}) == hashlib.blake2s(b"k" * 16, digest_size=32).digest()
    assert job_key.load_key(b"k" * 100, {}) == hashlib.blake2s(b"k" * 100, digest_size=32).digest()
    with pytest.raises(errors.HeartbeatKeyError, match="15 bytes; at least 16"):
        job_key.load_key(b"k" * 15, {})
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    with pytest.raises(errors.HeartbeatKeyError, match="SNEPPX_HEARTBEAT_KEY_FILE"):
        job_key.load_key(None, {ENV_HEARTBEAT_KEY_FILE: str(short)})


def test_unreadable_key_file_and_bad_hex_are_typed_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.HeartbeatKeyError, match="can't read"):
        job_key.load_key(None, {ENV_HEARTBEAT_KEY_FILE: str(tmp_path / "missing")})
    with pytest.raises(errors.HeartbeatKeyError, match="SNEPPX_HEARTBEAT_KEY is not a hex"):
        job_key.load_key(None, {ENV_HEARTBEAT_KEY: "not hex"})


@pytest.mark.parametrize(("text", "expected"), [
    ("10.0.0.2:29500", ("10.0.0.2", 29500)), ("node-1", ("node-1", 29500)), (":29511", ("", 29511)),
    ("", ("", 29500)), ("127.0.0.1:0", ("127.0.0.1", 0)),
])
def test_split_address(text: str, expected: tuple[str, int]) -> None:
    assert heartbeat.split_address(text) == expected


@pytest.mark.parametrize("text", ["[::1]:29500", "::1", "host:port", "host:70000"])
def test_bad_addresses_are_refused(text: str) -> None:
    with pytest.raises(errors.HeartbeatConfigError):
        heartbeat.split_address(text)


def test_binds_loopback_when_every_peer_is_loopback() -> None:
    """Recipe 2's default: the peer list's port (29500); on 127.0.0.1 when all peers are loopback. Port 0 here
    (SNEPPX_HEARTBEAT_BIND=:0) so the test never collides with a real 29500."""
    with HeartbeatMonitor(peers=["127.0.0.2:29501", "127.0.0.3:29502"], key=KEY,
                          environ={ENV_HEARTBEAT_BIND: ":0"}) as hb:
        assert hb.address.startswith("127.0.0.1:")
        assert hb.peers == ["127.0.0.2:29501", "127.0.0.3:29502"]
        assert hb.mode == "direct"


def test_own_address_in_the_list_is_dropped_and_duplicates_refused() -> None:
    probe = HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0")
    port = int(probe.address.rsplit(":", 1)[1])
    probe.stop()
    everyone = [f"127.0.0.1:{port}", "127.0.0.1:29998", "127.0.0.1:29999"]
    hb = HeartbeatMonitor(peers=everyone, key=KEY, bind=f"127.0.0.1:{port}")
    assert hb.peers == everyone[1:]
    hb.stop()
    with pytest.raises(errors.HeartbeatConfigError, match="listed twice"):
        HeartbeatMonitor(peers=["127.0.0.1:29998", "localhost:29998"], key=KEY, bind="127.0.0.1:0")


def test_port_in_use_is_a_typed_socket_error() -> None:
    with HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0") as first, \
            pytest.raises(errors.HeartbeatSocketError, match="in use"):
        HeartbeatMonitor(peers=[], key=KEY, bind=first.address)


def test_mode_switches_to_gossip_above_the_direct_limit() -> None:
    peers = [f"127.0.0.1:{30000 + i}" for i in range(17)]
    with HeartbeatMonitor(peers=peers, key=KEY, bind="127.0.0.1:0") as hb:
        assert hb.mode == "gossip"
    with HeartbeatMonitor(peers=peers[:16], key=KEY, bind="127.0.0.1:0") as hb:
        assert hb.mode == "direct"


def test_generation_only_moves_forward_and_a_stopped_monitor_stays_stopped() -> None:
    hb = HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0", generation=3)
    hb.set_generation(5)
    assert hb.generation == 5
    with pytest.raises(ValueError):
        hb.set_generation(4)
    hb.start()
    hb.stop()
    with pytest.raises(errors.HeartbeatError, match="stopped"):
        hb.start()


def test_interval_must_not_exceed_timeout() -> None:
    with pytest.raises(errors.HeartbeatConfigError, match="interval"):
        HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0", interval=1.0, timeout=0.5)


def test_first_contact_grace_defaults_to_zero_and_must_not_be_negative() -> None:
    with HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0") as hb:
        assert hb.first_contact_grace == 0.0
    with HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0", first_contact_grace=2.5) as hb:
        assert hb.first_contact_grace == 2.5
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(errors.HeartbeatConfigError, match="first_contact_grace"):
            HeartbeatMonitor(peers=[], key=KEY, bind="127.0.0.1:0", first_contact_grace=bad)
