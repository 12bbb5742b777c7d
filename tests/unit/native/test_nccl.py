"""NCCL through native/src/nccl.c: the loader, version and unique ids run for real on any machine (the
nvidia-nccl-cu12 wheel loads without a GPU); communicators and collectives need a GPU (`gpu` marker)."""

from __future__ import annotations

import importlib.metadata
import os
import threading

import numpy as np
import pytest
from directory_store import DirectoryStore

from SneppX_ALG import _native, collectives, errors

HAS_GPU = _native.cuda_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")


def test_nccl_search_order_env_override_then_wheel_then_soname(tmp_path: os.PathLike[str]) -> None:
    wheel_lib = os.path.join(tmp_path, "site", "nvidia", "nccl", "lib", "libnccl.so.2")
    os.makedirs(os.path.dirname(wheel_lib))
    open(wheel_lib, "wb").close()
    sys_path = [os.path.join(tmp_path, "empty"), os.path.join(tmp_path, "site")]
    assert _native.nccl_candidates(sys_path, {}) == [wheel_lib, "libnccl.so.2"]
    assert _native.nccl_candidates(sys_path, {"SNEPPX_NCCL": "/opt/nccl.so"}) == ["/opt/nccl.so"]
    assert _native.nccl_candidates([os.path.join(tmp_path, "empty")], {}) == ["libnccl.so.2"]


def test_libnccl_loads_from_the_wheel_and_reports_the_wheels_version() -> None:
    path = _native.nccl_load()
    assert path.endswith(os.path.join("nvidia", "nccl", "lib", "libnccl.so.2")) and os.path.exists(path)
    wheel = tuple(int(part) for part in importlib.metadata.version("nvidia-nccl-cu12").split(".")[:3])
    assert _native.nccl_version() == wheel
    assert _native.nccl_version() >= (2, 14, 3)  # non-blocking communicators


def test_unique_ids_are_fresh_128_byte_values() -> None:
    first, second = _native.nccl_unique_id(), _native.nccl_unique_id()
    assert len(first) == len(second) == _native.NCCL_UNIQUE_ID_BYTES == 128
    assert first != second


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a CUDA device")
def test_an_nccl_group_without_a_device_is_a_typed_error(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(errors.AcceleratorUnavailableError):
        collectives.ProcessGroup(DirectoryStore(tmp_path), 0, 1, backend="nccl", timeout=30)


def test_a_wrong_unique_id_length_is_refused_before_c() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        _native.NcclComm(b"short", 0, 1, 0, device=0, timeout=1)


# ---- on a GPU ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_one_rank_nccl_collectives_on_host_arrays(tmp_path: os.PathLike[str]) -> None:
    with collectives.ProcessGroup(DirectoryStore(tmp_path), 0, 1, backend="nccl", timeout=120) as group:
        values = np.arange(1001, dtype=np.float32)
        assert np.array_equal(group.allreduce(values.copy()), values)
        assert np.array_equal(group.allreduce(values.copy(), op="max"), values)
        assert np.array_equal(group.broadcast(np.arange(7, dtype=np.int64)), np.arange(7))
        assert np.array_equal(group.reduce_scatter(values.copy()), values)
        assert np.array_equal(group.allgather(values.copy()), values)
        group.barrier()


@pytest.mark.gpu
@gpu
def test_nccl_init_waiting_for_a_missing_rank_is_aborted_at_the_deadline(tmp_path: os.PathLike[str]) -> None:
    """Rank 1 of 2 never comes: without the watchdog, ncclCommInitRank would wait for it forever."""
    with pytest.raises(errors.CollectiveTimeoutError):
        collectives.ProcessGroup(DirectoryStore(tmp_path), 0, 2, backend="nccl", timeout=5)


@pytest.mark.gpu
@gpu
def test_nccl_abort_from_another_thread_fails_the_group(tmp_path: os.PathLike[str]) -> None:
    group = collectives.ProcessGroup(DirectoryStore(tmp_path), 0, 1, backend="nccl", timeout=120)
    thread = threading.Thread(target=group.abort)
    thread.start()
    thread.join()
    with pytest.raises(errors.CollectiveAbortedError):
        group.allreduce(np.ones(4, np.float32))
    group.close()
