"""`python -m bench [AREA ...] [-- ARGS]`: runs the named benchmark areas (all when none are named).

Each area is a module of this package with `main(argv)`; results are recorded in docs/BENCHMARKS.md.
"""

import importlib
import sys

AREAS = ["crc", "format", "model", "async_save", "signing", "restore", "heartbeat", "comm", "rendezvous",
         "sharded", "operator", "elastic", "incremental"]


def run(argv: list[str]) -> None:
    names, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    for name in names or AREAS:
        if name not in AREAS:
            sys.exit(f"unknown benchmark area {name!r}; choose from {', '.join(AREAS)}")
        print(f"\n## {name}\n", flush=True)
        importlib.import_module(f"bench.{name}").main(rest)


if __name__ == "__main__":
    run(sys.argv[1:])
