"""Test configuration: make ``gpu_util`` importable from every test directory; the store
fixtures (``server``, ``store``) the store test files share."""
import os
import sys

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)
_root = os.path.dirname(_here)
if _root not in sys.path:
    sys.path.insert(0, _root)


@pytest.fixture
def server():
    """A fresh ncclpy StoreServer on a free loopback port, closed after the test."""
    from ncclpy.store import StoreServer
    srv = StoreServer().start()
    yield srv
    srv.close()


@pytest.fixture
def store(server):
    """A client of ``server`` with a 10 s timeout."""
    from ncclpy.store import TCPStore
    with TCPStore(*server.address, timeout=10) as s:
        yield s
