"""The image built for this session (image_fixtures.py), and tests/k8s's real kube-apiserver fixtures."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "k8s"))
from image_fixtures import TAG, image  # noqa: F401  (pytest finds fixtures by name)
from k8s_fixtures import api, cluster, namespace  # noqa: F401
