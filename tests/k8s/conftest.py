"""The real kube-apiserver fixtures (k8s_fixtures.py) for every test in this directory."""

from k8s_fixtures import api, cluster, namespace, operator, pods  # noqa: F401  (pytest finds fixtures by name)
