"""`tandem scale`: add or drain workers of a running `tandem serve` (its POST /admin/workers), or list them.

    tandem scale --base-url http://127.0.0.1:8000 --role decode --delta 1     # returns once it serves
    tandem scale --base-url http://127.0.0.1:8000 --role decode --delta -1    # returns once it drains
    tandem scale --base-url http://127.0.0.1:8000                              # the workers and their states

Sends --api-key (as `Authorization: Bearer`) when given. Prints the server's answer: the workers by name with
role and state, and what changed; a refusal (400: bad role, past a bound; 401: the key; 503: a worker that did
not start) is printed with the server's reason and exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

ADMIN_WORKERS = "/admin/workers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the HTTP front end of tandem serve")
    parser.add_argument("--role", default=None, help="prefill, decode, or replica (colocated replicas)")
    parser.add_argument("--delta", type=int, default=None, help="+k adds k workers, -k drains k")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="how long to wait for the answer (adding waits until the new workers serve)")


def build_request(args: argparse.Namespace) -> urllib.request.Request:
    """GET /admin/workers without --role and --delta, else POST {"role", "delta"}; ValueError if only one
    of them is given."""
    if (args.role is None) != (args.delta is None):
        raise ValueError("--role and --delta go together (neither: list the workers)")
    url = args.base_url.rstrip("/") + ADMIN_WORKERS
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.role is None:
        return urllib.request.Request(url, headers=headers, method="GET")
    body = json.dumps({"role": args.role, "delta": args.delta}).encode()
    return urllib.request.Request(url, data=body, headers={**headers, "Content-Type": "application/json"},
                                  method="POST")


def run(args: argparse.Namespace) -> int:
    request = build_request(args)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        print(f"tandem scale: HTTP {error.code}: {_reason(error.read())}", file=sys.stderr)
        return 1
    except urllib.error.URLError as error:
        print(f"tandem scale: cannot reach {args.base_url}: {error.reason}", file=sys.stderr)
        return 1
    print(describe(answer))
    return 0


def describe(answer: dict) -> str:
    """The answer as lines: what changed, then one line per worker (name, role, state)."""
    lines = []
    if answer.get("started"):
        lines.append("started: " + ", ".join(answer["started"]))
    if answer.get("draining"):
        lines.append("draining: " + ", ".join(answer["draining"]) + " (each stops when its requests end)")
    for name, worker in (answer.get("workers") or {}).items():
        lines.append(f"{name:<14} {worker.get('role', ''):<8} {worker.get('state', '')}")
    return "\n".join(lines)


def _reason(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem scale", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
