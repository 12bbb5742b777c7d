"""Recipe 2 of the cookbook, as written: an async coordinator save, a HeartbeatMonitor, a quorum.

Two deliberate differences, as for every recipe test: the example peers 10.0.0.2 and 10.0.0.3 become the
loopback addresses 127.0.0.2 and 127.0.0.3, and the ports are free ones picked for this run instead of 29500
(tests run in parallel with other tests and must not collide on a fixed port). Everything else comes from the
environment the operator gives a rank: the key file (raw bytes of the job's Secret) and the bind address. The
two peers are real monitor processes.
"""

from __future__ import annotations

import pathlib
import secrets

import pytest
from heartbeat_peers import Member, free_udp_ports

from SneppX_ALG import Transformer


@pytest.mark.timeout(300)
def test_recipe_2_as_written(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = secrets.token_bytes(32)
    key_file = tmp_path / "heartbeat-key"
    key_file.write_bytes(key)
    (me_port,), (port_2,), (port_3,) = free_udp_ports(1), free_udp_ports(1, "127.0.0.2"), free_udp_ports(1, "127.0.0.3")
    me, peer_2, peer_3 = f"127.0.0.1:{me_port}", f"127.0.0.2:{port_2}", f"127.0.0.3:{port_3}"
    peers = [Member(address, [me, peer_2, peer_3], key_hex=key.hex(), interval=0.1, timeout=1.0)
             for address in (peer_2, peer_3)]
    monkeypatch.setenv("SNEPPX_HEARTBEAT_KEY_FILE", str(key_file))
    monkeypatch.setenv("SNEPPX_HEARTBEAT_BIND", me)
    ckpts = tmp_path / "ckpts"
    model = Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64)
    try:
        for p in peers:
            assert "ready" in p.reply(timeout=120)

        # ---- recipe 2, as written ----
        from SneppX_ALG import CheckpointCoordinator, FaultToleranceManager, HeartbeatMonitor

        coord = CheckpointCoordinator(
            checkpoint_root=str(ckpts),
            save_every_n_steps=1000,
            max_to_keep=5,
            async_save=True,                # background I/O thread
        )
        coord.save(model, step=1000)        # returns immediately

        hb  = HeartbeatMonitor(peers=[peer_2, peer_3])
        ft  = FaultToleranceManager(heartbeat=hb, max_restarts=3)
        ft.wait_for_quorum()                # blocks until >50% peers healthy
        # ---- end of recipe 2 ----

        coord.wait()
        assert coord.committed_steps() == [1000] and coord.latest().step == 1000
        assert hb.address == me and len(hb.healthy_peers()) >= 1 and ft.is_quorum_met()
        for p in peers:  # and the peers hear us: authenticated both ways with the key file's bytes
            assert p.wait_event("healthy", me, timeout=30)
        assert sum(hb.drops().values()) == 0
        coord.close()
        hb.stop()
    finally:
        for p in peers:
            p.close()
