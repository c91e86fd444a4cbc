"""``ncclpy.bootstrap`` as the reference documents it (docs/reference/api/launch.rst): the module
``ncclpy.bootstrap`` (so ``ncclpy.bootstrap.bootstrap``, ``ncclpy.bootstrap.Bootstrap`` ...) and,
called, the function -- whichever was imported first.  Each spelling runs in a fresh
interpreter: what ran before in this one must not decide the answer (issue 38, item 13)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# after each prelude, `ncclpy` is the package and `mod` whatever the spelling gave
_PRELUDES = {
    "import ncclpy": "import ncclpy\nmod = ncclpy.bootstrap",
    "import ncclpy.bootstrap": "import ncclpy.bootstrap\nmod = ncclpy.bootstrap",
    "import ncclpy, then ncclpy.bootstrap": "import ncclpy\nncclpy.Bootstrap\n"
                                            "import ncclpy.bootstrap\nmod = ncclpy.bootstrap",
    "from ncclpy import bootstrap": "import ncclpy\nfrom ncclpy import bootstrap as mod",
    "from ncclpy import *": "import ncclpy\nfrom ncclpy import *\nmod = bootstrap",
}

_CHECKS = """
import inspect, sys, types
real = sys.modules["ncclpy.bootstrap"]
assert mod is real, mod
assert isinstance(mod, types.ModuleType)
assert ncclpy.bootstrap is real
fn = ncclpy.bootstrap.bootstrap
assert inspect.isfunction(fn) and fn.__name__ == "bootstrap", fn
assert ncclpy.bootstrap.Bootstrap is ncclpy.Bootstrap
assert callable(ncclpy.bootstrap.exchange_uid) and ncclpy.bootstrap.UID_BYTES == 128
assert "name" in inspect.signature(ncclpy.bootstrap).parameters
b1 = ncclpy.bootstrap("solo", rank=0, world_size=1, env={}, timeout=30)
b2 = ncclpy.bootstrap.bootstrap("solo", rank=0, world_size=1, env={}, timeout=30,
                                master_port=b1.info.master_port)
assert isinstance(b1, ncclpy.Bootstrap) and isinstance(b2, ncclpy.bootstrap.Bootstrap)
assert (b1.generation, b2.generation) == (1, 2) and len(b1.uid) == 128
print("OK")
"""


@pytest.mark.parametrize("spelling", list(_PRELUDES))
def test_ncclpy_bootstrap_is_the_module_and_calls_the_function(spelling):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for k in ("NCCLPY_STORE_TOKEN", "NCCLPY_MASTER_PORT", "MASTER_PORT", "NCCLPY_RANK", "RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", _PRELUDES[spelling] + _CHECKS],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_the_reference_says_what_the_package_does():
    with open(os.path.join(ROOT, "docs", "reference", "api", "launch.rst")) as f:
        text = f.read()
    assert ".. autofunction:: ncclpy.bootstrap.bootstrap" in text
    assert "``ncclpy.bootstrap`` is both this module and, called," in text
