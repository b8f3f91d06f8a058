"""The fake multi-node Ray cluster (tests/support/fake_nodes.py) shared by the tests of this package.

Starting it (a head and three raylets) and stopping it costs ~15 s on the 2-core CI machine, so it is started
once for the package and stopped, checked to leave no process, after its last test. Sharing is safe: every
test of test_multinode.py ends with no actor, placement group or worker left (assert_released) and adds back
the node it removes; test_multinode_scaling.py (run after it) holds its one cluster of workers for its module,
releases it at the end and removes the fourth node it adds; test_tp_multinode.py adds two nodes of 2 CPUs,
releases its workers and removes both.
"""
from __future__ import annotations

import pytest

from tests.support.fake_nodes import start_fake_cluster, stop_fake_cluster


@pytest.fixture(scope="package")
def fake():
    """The head and nodes a, b, c on 127.0.0.2, this process connected to it as a driver."""
    fake = start_fake_cluster()
    yield fake
    stop_fake_cluster(fake)
