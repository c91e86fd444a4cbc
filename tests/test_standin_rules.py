"""Every scenario of tests/nccl_rules_scenarios.py on the STAND-IN (CPU): its observation must be
the one NCCL's source gives (the row of ncclpy/cpu/RULES.md it names).  The same
scenarios run on the real libnccl in tests/gpu/test_standin_differential.py."""
from __future__ import annotations

import pytest

import nccl_rules_scenarios as S
from nccl_standin import check_violations, standin

#: 2.28.9 (the project's GPU machine) and 2.30.7 (the newest tag: revoke, shrink, suspend, ...)
VERSIONS = (22809, 23007)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sid", [s.id for s in S.SCENARIOS])
def test_the_standin_does_what_nccl_does(sid, version):
    s = S.by_id(sid)
    with standin(version=version) as eng:
        from ncclpy._nccl.lib import get_lib
        lib = get_lib()
        assert lib is eng.nccl
        got = S.run_one(s, lib)
        if "obs" in got:      # the violations the scenario commits on purpose, exactly those
            check_violations(eng.violations, s.violations)
            eng.violations.clear()
    if "skip" in got:
        assert s.missing(eng.nccl), got          # only a version gate may skip on the stand-in
        pytest.skip(got["skip"])
    assert "error" not in got, got["error"]
    assert got["obs"] == s.expect(version), f"row {s.row}: stand-in {got['obs']}"


def test_the_scenarios_cover_the_table_and_compare_real_observations():
    """Ids are unique, every scenario names a row, and an observation that differs is caught
    (the comparison is not vacuous)."""
    ids = [s.id for s in S.SCENARIOS]
    assert len(ids) == len(set(ids)) and 15 <= len(ids) <= 30
    assert all(s.row and s.needs for s in S.SCENARIOS)
    with standin(version=23007, expect_violations=["ncclCommFinalize twice"]) as eng:
        got = S.run_one(S.by_id("finalize-twice"), eng.nccl)["obs"]
    assert got == S.by_id("finalize-twice").expect(23007)
    assert dict(got, second=0) != S.by_id("finalize-twice").expect(23007)
