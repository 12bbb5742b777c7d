"""`python -m sneppx_operator`: run the operator with the project's kopf settings (config.py).

The same handlers run under `kopf run -m sneppx_operator.handlers` (one replica, no election); this entry
point picks the scope (all namespaces unless --namespace is given), leader election (--leader-elect: replicas
elect one leader on a Lease, leader.py), probes and the Prometheus endpoint (--metrics HOST:PORT).
"""

from __future__ import annotations

import argparse
import os
import pathlib

import kopf

from sneppx_operator import (
    handlers,  # importing registers the handlers with kopf
    leader,
    metrics,
)

NAMESPACE_FILE = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


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
        "--leader-elect",
        action="store_true",
        help="elect one acting replica on a coordination.k8s.io Lease (run several replicas with this)",
    )
    parser.add_argument(
        "--leader-election-namespace",
        metavar="NS",
        default=None,
        help="the Lease's namespace (default: $POD_NAMESPACE, else the pod's own namespace)",
    )
    parser.add_argument(
        "--leader-election-id", metavar="NAME", default="sneppx-operator", help="the Lease's name"
    )
    parser.add_argument("--lease-label", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                        help="a label of the Lease when a replica creates it (repeatable)")
    parser.add_argument("--lease-owner-deployment", metavar="NAME", default=None,
                        help="the operator's Deployment: a Lease a replica creates is deleted with it")
    parser.add_argument("--lease-duration", type=float, default=leader.LEASE_DURATION_S, metavar="S",
                        help="seconds a Lease nobody renews stays taken (default %(default)s)")
    parser.add_argument("--renew-deadline", type=float, default=leader.RENEW_DEADLINE_S, metavar="S",
                        help="seconds the leader may act after its last renewal (default %(default)s)")
    parser.add_argument("--retry-period", type=float, default=leader.RETRY_PERIOD_S, metavar="S",
                        help="seconds between tries to take or renew the Lease (default %(default)s)")
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


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def election_namespace(given: str | None) -> str:
    if given:
        return given
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return NAMESPACE_FILE.read_text().strip()
    except OSError:
        raise SystemExit("--leader-elect needs --leader-election-namespace (or POD_NAMESPACE) outside a pod") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    if args.leader_elect:
        if not args.retry_period < args.renew_deadline < args.lease_duration:
            raise SystemExit("leader election needs --retry-period < --renew-deadline < --lease-duration")
        handlers.ELECTION = handlers.Election(
            election_namespace(args.leader_election_namespace), args.leader_election_id,
            args.lease_duration, args.renew_deadline, args.retry_period,
            dict(args.lease_label), args.lease_owner_deployment,
        )
    if args.metrics:
        metrics.serve(args.metrics)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=True,
        liveness_endpoint=args.liveness,
    )


if __name__ == "__main__":
    main()
