"""CPU tests of the GPU-readiness fixes (issue 13) that can be shown without a GPU.

Each test uses the real libnccl and CuPy's real classes; what needs a GPU (a nonblocking split,
registrations of one buffer twice, NCCL_COMM_BLOCKING=0 end to end) is in tests/gpu.
"""
from __future__ import annotations

import ctypes

import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl import config as C
from ncclpy._nccl.config import CONFIG_UNDEF_INT, Config


def _lib():
    try:
        return ncclpy._nccl.get_lib()
    except errors.MissingDependencyError as e:  # pragma: no cover - CI installs the extra
        pytest.skip(str(e))


# -- 2: codes CuPy cannot represent -----------------------------------------------------------

@pytest.mark.parametrize("code", [7, 8])
def test_cupy_cannot_build_its_error_for_7_and_8(code):
    """The defect itself, with CuPy's own function: its NcclError has no message for 7/8."""
    lib = _lib()
    with pytest.raises(KeyError) as ei:
        lib.cupy_nccl.check_status(code)
    assert ei.value.args == (code,)


def test_cupy_timeout_becomes_ncclpy_timeout_error():
    lib = _lib()
    from ncclpy._nccl.dispatch import call_cupy
    with pytest.raises(errors.NcclTimeoutError) as ei:
        call_cupy(lib, "ncclCommSplit", None, lib.cupy_nccl.check_status, 8)
    assert ei.value.code == 8 and ei.value.call == "ncclCommSplit"
    assert "ncclTimeout (8)" in str(ei.value)


def test_cupy_in_progress_is_returned_not_raised():
    lib = _lib()
    from ncclpy._nccl.dispatch import call_cupy
    assert call_cupy(lib, "ncclCommInitRank", None, lib.cupy_nccl.check_status, 7) == (7, None)
    assert call_cupy(lib, "x", None, lambda a: a + 1, 41) == (0, 42)


def test_cupy_codes_1_to_6_keep_their_classes():
    lib = _lib()
    from ncclpy._nccl.dispatch import call_cupy
    for code, cls in ((1, errors.NcclUnhandledCudaError), (4, errors.NcclInvalidArgument),
                      (5, errors.NcclInvalidUsage), (6, errors.NcclRemoteError)):
        with pytest.raises(cls) as ei:
            call_cupy(lib, "ncclAllReduce", None, lib.cupy_nccl.check_status, code)
        assert ei.value.code == code


def test_unrelated_key_errors_pass_through():
    lib = _lib()
    from ncclpy._nccl.dispatch import call_cupy, cupy_status

    def boom():
        raise KeyError("not an NCCL code")
    with pytest.raises(KeyError):
        call_cupy(lib, "x", None, boom)
    assert cupy_status(KeyError(9), lib) is None
    assert cupy_status(KeyError(7, 8), lib) is None


class _Waits:
    """Records _wait_ready calls (the dispatch wrapper's callback into its communicator)."""

    def __init__(self) -> None:
        self.calls = []

    def _wait_ready(self, call):
        self.calls.append(call)


def test_dispatch_through_cupy_waits_on_in_progress_and_raises_timeout():
    lib = _lib()
    from ncclpy._nccl import dispatch
    comm = _Waits()
    status = {"code": 7}
    call = dispatch._cupy_call(comm, lib, 0, lambda *a: lib.cupy_nccl.check_status(status["code"]),
                               "ncclAllReduce")
    call(1, 2, 3, stream=0)
    assert comm.calls == ["ncclAllReduce"]
    status["code"] = 8
    with pytest.raises(errors.NcclTimeoutError) as ei:
        call(1, 2, 3, stream=0)
    assert ei.value.call == "ncclAllReduce"
    # inside a group NCCL launches at the group end: no wait per call
    from ncclpy.comm.execute import group_scope
    status["code"] = 7
    with group_scope(dispatch.lib_group(lib, "ncclGroupStart"),
                     dispatch.lib_group(lib, "ncclGroupEnd")):
        call(stream=0)
    assert comm.calls == ["ncclAllReduce"]


def test_cupy_init_failure_is_converted_and_group_depth_repaired():
    lib = _lib()
    from ncclpy._nccl.dispatch import call_cupy, cupy_init
    from gpu_util import cuda_reason
    if not cuda_reason():  # pragma: no cover - GPU machines
        pytest.skip("checks the no-driver failure; a GPU is present")
    with pytest.raises(errors.NcclUnhandledCudaError):
        call_cupy(lib, "ncclCommInitRank", None, cupy_init, lib.cupy_nccl, 1,
                  lib.get_unique_id(), 0)
    lib.repair_group_depth()
    assert lib.ncclGroupEnd() == 5, "NCCL group depth left raised"


# -- 3: NCCL_COMM_BLOCKING from the environment ------------------------------------------------

@pytest.mark.parametrize("value,want", [
    (None, None), ("", None), ("0", 0), ("1", 1), ("2", 2), ("-1", -1), (" 1", 1),
    ("0x10", 16), ("012", 10), ("08", 0), ("7abc", 7), ("off", 0), ("0x", 0),
    ("99999999999999999999", None)])
def test_nccl_env_int_reads_like_strtoll_base_0(value, want):
    assert C.nccl_env_int(value) == want


@pytest.mark.parametrize("env,config,nonblocking", [
    ({}, None, False),
    ({}, Config(), False),
    ({}, Config(blocking=False), True),
    ({}, Config(blocking=True), False),
    ({"NCCL_COMM_BLOCKING": "0"}, None, True),
    ({"NCCL_COMM_BLOCKING": "0"}, Config(blocking=True), True),
    ({"NCCL_COMM_BLOCKING": "1"}, Config(blocking=False), False),
    ({"NCCL_COMM_BLOCKING": "2"}, Config(blocking=False), True),    # NCCL ignores 2
    ({"NCCL_COMM_BLOCKING": "2"}, None, False),
    ({"NCCL_COMM_BLOCKING": "no"}, None, True),                    # strtoll("no") == 0
])
def test_effective_blocking_mode_follows_the_environment(env, config, nonblocking):
    assert C.effective_nonblocking(config, 23203, env) is nonblocking


def test_nccl_before_2_14_has_no_blocking_variable():
    assert C.effective_nonblocking(None, 21300, {"NCCL_COMM_BLOCKING": "0"}) is False


def test_environment_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    assert C.effective_nonblocking(None, 23203) is True
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "1")
    assert C.effective_nonblocking(Config(blocking=False), 23203) is False


@pytest.mark.parametrize("env,config,route", [
    ({}, None, "cupy"), ({"NCCL_COMM_BLOCKING": "1"}, None, "cupy"),
    ({"NCCL_COMM_BLOCKING": "0"}, None, "ctypes"), ({}, Config(), "ctypes"),
    ({"NCCL_COMM_BLOCKING": "1"}, Config(blocking=False), "ctypes")])
def test_creation_route(env, config, route):
    """A config-less communicator made nonblocking by NCCL_COMM_BLOCKING=0 is created through
    ncclCommInitRankConfig (its ncclInProgress would be CuPy's KeyError), with NCCL's defaults."""
    s = C.init_struct(config, 23203, env)
    assert (s is None) == (route == "cupy")
    if s is not None and config is None:
        assert bytes(s) == bytes(Config().to_struct(23203))


# -- 4, 5, 6: Config fields NCCL would drop or refuse ------------------------------------------

@pytest.mark.parametrize("field,value,first", [("traffic_class", 3, 22600),
                                                ("comm_name", "x", 22700)])
def test_config_fields_gated_where_ncclconfig_t_gained_them(field, value, first):
    cfg = Config(**{field: value})
    with pytest.raises(errors.VersionError) as ei:
        cfg.to_struct(first - 1)
    msg = str(ei.value)
    assert f"Config.{field}" in msg and ncclpy.ops.format_version(first) in msg
    assert ncclpy.ops.format_version(first - 1) in msg
    s = cfg.to_struct(first)
    got = getattr(s, C.CONFIG_FIELDS[field][0])
    assert got == (value.encode() if isinstance(value, str) else value)


@pytest.mark.parametrize("version,want", [(21400, 1), (21500, 1), (21603, 1),
                                          (21700, CONFIG_UNDEF_INT), (23203, CONFIG_UNDEF_INT)])
def test_unset_blocking_is_written_as_1_on_nccl_2_14_to_2_16(version, want):
    assert Config().to_struct(version).blocking == want


def test_set_blocking_is_written_as_given_on_every_version():
    for version in (21400, 21603, 23203):
        assert Config(blocking=False).to_struct(version).blocking == 0
        assert Config(blocking=True).to_struct(version).blocking == 1
    assert Config().to_struct().blocking == CONFIG_UNDEF_INT   # no version: NCCL's unset


@pytest.mark.parametrize("min_ctas,max_written", [(1, 64), (4, 64), (64, 64), (100, 100)])
def test_min_ctas_alone_gets_a_max_nccl_accepts(min_ctas, max_written):
    """NCCL checks ``minCTAs > maxCTAs`` before filling defaults, and INT_MIN (unset max) is
    smaller than any min: ncclpy writes a max, so NCCL's own check passes."""
    s = Config(min_ctas=min_ctas).to_struct(23203)
    assert s.minCTAs == min_ctas and s.maxCTAs == max_written
    assert not s.minCTAs > s.maxCTAs


@pytest.mark.parametrize("version,min_ctas,max_written", [
    (21700, 1, 32), (22400, 4, 32), (22400, 40, 40), (22500, 4, 64), (None, 4, 64)])
def test_min_ctas_alone_fills_the_channel_limit_of_that_nccl(version, min_ctas, max_written):
    """Issue 21, defect 8: NCCL 2.17-2.24's limit is 32 channels (they warn about 64)."""
    s = Config(min_ctas=min_ctas).to_struct(version)
    assert s.maxCTAs == max_written and not s.minCTAs > s.maxCTAs


def test_max_ctas_alone_and_both_are_written_as_given():
    s = Config(max_ctas=8).to_struct(23203)
    assert s.maxCTAs == 8 and s.minCTAs == CONFIG_UNDEF_INT
    s = Config(min_ctas=2, max_ctas=8).to_struct(23203)
    assert (s.minCTAs, s.maxCTAs) == (2, 8)


# -- 7: device copies with the communicator's device current ----------------------------------

class _Runtime:
    """CUDA runtime device calls, recorded (the scope helper's only dependency)."""

    def __init__(self, current: int) -> None:
        self.current = current
        self.sets = []

    def get_device(self) -> int:
        return self.current

    def set_device(self, d: int) -> None:
        self.sets.append(d)
        self.current = d


def test_device_current_switches_and_restores():
    from ncclpy.comm.execute import device_current
    rt = _Runtime(0)
    with device_current(rt, 1):
        assert rt.current == 1
    assert rt.current == 0 and rt.sets == [1, 0]
    rt = _Runtime(2)
    with pytest.raises(RuntimeError):
        with device_current(rt, 1):
            raise RuntimeError("copy failed")
    assert rt.current == 2


def test_device_current_costs_nothing_when_already_current():
    from ncclpy.comm.execute import device_current
    rt = _Runtime(1)
    with device_current(rt, 1):
        pass
    assert rt.sets == []


# -- 8: only the failing call's NCCL text ------------------------------------------------------

def test_stale_last_error_text_is_not_shown():
    lib = _lib()
    x = ctypes.c_int(0)
    lib.error(lib.ncclCommCount(None, ctypes.byref(x)), "ncclCommCount")  # some other text first
    assert lib.ncclGroupEnd() == 5           # NCCL writes "ncclGroupEnd: not in a group call."
    first = lib.error(5, "ncclGroupEnd")
    assert "not in a group call" in first.last_error
    # a later failure that writes no text of its own must not borrow that one
    later = lib.error(3, "ncclAllReduce")
    assert "not in a group call" not in str(later)
    assert later.last_error == lib.error_string(3)


def test_repair_group_end_leaves_no_text_behind():
    lib = _lib()
    lib.repair_group_depth()                 # its last ncclGroupEnd writes "not in a group"
    err = lib.error(1, "ncclCommInitRank")
    assert "not in a group" not in str(err) and err.last_error == lib.error_string(1)


def test_fresh_text_is_shown():
    lib = _lib()
    x = ctypes.c_int(0)
    lib.ncclGroupEnd()
    lib.mark_seen()
    code = lib.ncclCommCount(None, ctypes.byref(x))
    assert code == 4
    err = lib.error(code, "ncclCommCount")
    assert "comm argument is NULL" in err.last_error
    code = lib.ncclRedOpDestroy(0, None)     # a different text: shown too
    assert "builtin" in lib.error(code, "ncclRedOpDestroy").last_error


# -- 10: registrations -------------------------------------------------------------------------

def test_registrations_of_one_handle_are_distinct_entries():
    from ncclpy.comm import Registration
    a, b = Registration(0x1234, 0x7000, 64), Registration(0x1234, 0x7000, 64)
    assert a.id != b.id and a != b and a == a
    n1, n2 = Registration(0, 0x7000, 64), Registration(0, 0x7000, 64)   # NULL handles
    assert len({n1.id, n2.id, a.id, b.id}) == 4
