"""The image built for this session (container_image.py), and tests/k8s's real kube-apiserver fixtures."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import container_image
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "k8s"))
from k8s_fixtures import api, cluster, namespace  # noqa: F401  (pytest finds fixtures by name)

TAG = "localhost/sneppx:test"


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[container_image.Image]:
    """The image built from ./Dockerfile for this session (the base comes from the cache once built)."""
    try:
        with container_image.built_image(tmp_path_factory.mktemp("buildah"), TAG) as built:
            yield built
    except container_image.Unavailable as reason:
        pytest.skip(str(reason))
