"""`python -m sneppx_operator`: run the operator with the project's kopf settings (config.py).

The same handlers run under `kopf run -m sneppx_operator.handlers`; this entry point only picks the
scope (all namespaces unless --namespace is given), peering (off unless --peering NAME), probes and the
Prometheus endpoint (--metrics HOST:PORT).
"""

from __future__ import annotations

import argparse

import kopf

from sneppx_operator import (
    handlers,  # noqa: F401  (importing registers the handlers with kopf)
    metrics,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sneppx_operator", description="SneppX operator: runs ElasticTrainingJob resources."
    )
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; globs allowed); default: all namespaces",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="enable kopf peering under this name (off by default: one replica runs)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        default=None,
        help="serve Prometheus metrics on /metrics, e.g. 0.0.0.0:8081 (off by default)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    if args.metrics:
        metrics.serve(args.metrics)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )


if __name__ == "__main__":
    main()
