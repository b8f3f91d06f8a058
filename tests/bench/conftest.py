"""What the bench tests share: one `tandem serve` with default flags for the runs of `tandem bench serve`."""
from __future__ import annotations

import pytest

from tests.support.serve_process import start_serve


@pytest.fixture(scope="package")
def default_server_port() -> int:
    """The HTTP port of one `tandem serve --model tiny` with no other flag (the colocated engine in its process)
    on free loopback ports, started once for the package instead of once per test (~4 s each on the 2-core CI
    machine) and stopped after the package's last test. Shared by the tests that point `tandem bench serve` at
    it: safe, as none of them stops, signals or reconfigures the server, and each checks only the report of its
    own run (its requests all complete; greedy ones are unchanged by what an earlier run left in the prefix
    cache, and nothing the reports count depends on it)."""
    with start_serve() as (proc, _, http_port):
        yield http_port
        assert proc.poll() is None, "the shared tandem serve exited while the tests used it"
