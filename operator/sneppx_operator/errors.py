"""The operator's own errors, under the project's SneppXError: a job spec the CRD schema can't judge alone, and
the operator's own configuration."""

from __future__ import annotations

from SneppX_ALG.errors import SneppXError


class JobSpecError(SneppXError, ValueError):
    """An ElasticTrainingJob asks for something the operator can't build (e.g. a reserved volume name)."""


class OperatorConfigError(SneppXError, ValueError):
    """The operator's own configuration (environment, command line) is invalid."""
