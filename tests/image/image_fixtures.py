"""The image fixture, shared by tests/image and tests/node (each conftest imports it; the session stash keeps it
one build)."""

from __future__ import annotations

import contextlib

import container_image
import pytest

TAG = "localhost/sneppx:test"
# The first test to ask for the image builds it in its setup, inside pytest-timeout's limit per test: 900 s was
# too short for the build at load 20-25 with the suite's other workers beside it (two builds, 7 December).
# The tests that use the image take this limit instead (a hang guard, no assertion).
BUILD_TIMEOUT = pytest.mark.timeout(1800)
_BUILT = pytest.StashKey[container_image.Image]()
_UNAVAILABLE = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> container_image.Image:
    """The image built from ./Dockerfile for this session (the base comes from the cache once built)."""
    stash = request.config.stash
    if _UNAVAILABLE in stash:
        pytest.skip(stash[_UNAVAILABLE])
    if _BUILT not in stash:
        built = contextlib.ExitStack()
        try:
            stash[_BUILT] = built.enter_context(
                container_image.built_image(tmp_path_factory.mktemp("buildah"), TAG))
        except container_image.Unavailable as reason:
            stash[_UNAVAILABLE] = str(reason)
            pytest.skip(str(reason))
        request.config.add_cleanup(built.close)
    return stash[_BUILT]
