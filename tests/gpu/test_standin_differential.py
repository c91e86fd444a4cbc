"""The differential stage of issue 35: every scenario of tests/nccl_rules_scenarios.py on the real
libnccl (one process, one GPU, 1-rank communicators: ``python tests/nccl_rules_scenarios.py``,
bounded) and on the STAND-IN at the same NCCL version (in this process, no GPU); one test per
scenario fails when real != expected (the table's reading of NCCL's source is wrong) or
real != stand-in (the stand-in is wrong).  Skipped with the reason where CUDA or NCCL is
absent."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import nccl_rules_scenarios as S  # noqa: E402

RUN_S = 150           # the real run of every scenario (a hung NCCL call ends it)
pytestmark = pytest.mark.timeout(RUN_S + 60)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """{scenario id: result} of the real libnccl, and its version (one subprocess)."""
    out = tmp_path_factory.mktemp("standin-diff") / "real.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, TESTS, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, os.path.join(TESTS, "nccl_rules_scenarios.py"), str(out)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=RUN_S)
        tail = (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {RUN_S} s; {(e.stderr or b'')[-3000:]!r}"
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    if not lines:
        pytest.fail(f"the real run wrote nothing: {tail}")
    return lines[0]["version"], {r["id"]: r for r in lines[1:]}, tail


@requires_gpu
@pytest.mark.gpu_world(1)
@pytest.mark.parametrize("sid", [s.id for s in S.SCENARIOS])
def test_real_nccl_and_the_standin_agree(real_run, sid):
    from nccl_standin import check_violations, standin
    version, results, tail = real_run
    s = S.by_id(sid)
    real = results.get(sid)
    if real is None:
        pytest.fail(f"row {s.row}: the real run never reached {sid} (it hung or crashed "
                    f"in or before it): {tail}")
    if "skip" in real:
        pytest.skip(f"row {s.row}: {real['skip']}")
    with standin(version=version) as eng:
        stand = S.run_one(s, eng.nccl)
        if "obs" in stand:    # the violations the scenario commits on purpose, exactly those
            check_violations(eng.violations, s.violations)
            eng.violations.clear()
    problems = []
    if "error" in real:
        problems.append(f"the real run raised {real['error']}")
    elif real["obs"] != s.expect(version):
        problems.append(f"real NCCL {version} gives {real['obs']}, the table expects "
                        f"{s.expect(version)}")
    if "skip" not in stand and stand.get("obs") != real.get("obs"):
        problems.append(f"the stand-in gives {stand.get('obs', stand.get('error'))}, real "
                        f"NCCL {real.get('obs', real.get('error'))}")
    assert not problems, f"row {s.row} ({sid}): " + "; ".join(problems)
