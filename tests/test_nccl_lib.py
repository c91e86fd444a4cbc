"""CPU tests of ncclpy's libnccl binding, Config marshalling, groups and the communicator's
error paths, all against the real libnccl that CuPy loads (no GPU needed, nothing faked)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import time

import pytest

from gpu_util import cuda_reason

import ncclpy
from ncclpy import errors
from ncclpy._nccl import lib as L
from ncclpy._nccl.config import (CONFIG_FIELDS, CONFIG_MAGIC, CONFIG_UNDEF_INT,
                                 CONFIG_VERSION, Config, NcclConfigStruct)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = bool(cuda_reason())


def _cupy():
    """CuPy, for the tests that use it; libnccl is loaded through it, so the tests that call
    NCCL skip without it too (:func:`_nccl_or_skip`), and the rest run."""
    return pytest.importorskip("cupy")


def _nccl_or_skip():
    try:
        return L.get_lib()
    except errors.MissingDependencyError as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"NCCL not loadable here: {e}")


def _run_py(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# -- library location ---------------------------------------------------------------------

def test_import_ncclpy_loads_nothing_heavy():
    r = _run_py("""
        import sys, json
        import ncclpy, ncclpy.comm, ncclpy.comm.work, ncclpy.comm.streams
        import ncclpy.comm.execute, ncclpy._nccl
        maps = open('/proc/self/maps').read()
        print(json.dumps({'cupy': 'cupy' in sys.modules, 'torch': 'torch' in sys.modules,
                          'nccl': 'libnccl' in maps, 'loaded': ncclpy._nccl.is_loaded()}))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "cupy": False, "torch": False, "nccl": False, "loaded": False}


def test_binds_the_copy_cupy_loaded_and_no_second_one():
    _cupy()
    r = _run_py("""
        import json
        import cupy.cuda.nccl
        from ncclpy._nccl import lib as L
        before = L.loaded_nccl_paths('maps')
        lib = L.get_lib()
        after = L.loaded_nccl_paths('maps')
        inodes = {l.split()[4] for l in open('/proc/self/maps')
                  if L._LIB_RE.search(l.rsplit('/', 1)[-1].strip())}
        pf = None
        try:
            import cupy._environment as e
            d = e._preload_libs.get('nccl') or {}
            if 'pathfinder' in d:
                pf = [d['pathfinder'].abs_path, d['pathfinder']._handle_uint]
        except Exception:
            pass
        print(json.dumps({'before': before, 'after': after, 'path': lib.path,
                          'phdr': L.loaded_nccl_paths('phdr'), 'inodes': sorted(inodes),
                          'handle': lib.cdll._handle, 'pathfinder': pf}))
    """)
    if r.returncode != 0 and "MissingDependencyError" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(d["before"]) == 1, d
    assert d["before"] == d["after"] == d["phdr"] == [d["path"]]
    assert len(d["inodes"]) == 1, "more than one libnccl file is mapped"
    assert os.path.basename(d["path"]).startswith("libnccl.so")
    if d["pathfinder"]:  # CuPy >= 14 records what cuda-pathfinder loaded
        assert os.path.realpath(d["pathfinder"][0]) == os.path.realpath(d["path"])
        assert d["pathfinder"][1] == d["handle"], "dlopen(RTLD_NOLOAD) gave another handle"


def test_version_matches_cupy_and_wheel():
    _cupy()
    lib = _nccl_or_skip()
    from cupy.cuda import nccl
    assert lib.version == nccl.get_version() == lib.cupy_version
    assert lib.version >= 20000
    try:
        import importlib.metadata as md
        for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
            try:
                ver = md.version(dist)
            except md.PackageNotFoundError:
                continue
            if os.sep + "nvidia" + os.sep + "nccl" in lib.path:
                major, minor, patch = (int(x) for x in ver.split(".")[:3])
                assert lib.version == L.nccl_version_code(major, minor, patch)
            break
    except ImportError:  # pragma: no cover
        pass


def test_unique_id_through_ctypes():
    lib = _nccl_or_skip()
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and len(b) == 128
    assert a != b
    assert L.UniqueId.from_bytes(a).to_bytes() == a


def test_every_binding_resolves_with_its_signature():
    lib = _nccl_or_skip()
    for name, (restype, argtypes, need) in L.FUNCTIONS.items():
        if lib.version < need:
            with pytest.raises(errors.VersionError):
                lib.fn(name)
            continue
        f = lib.fn(name)
        assert f.restype is restype, name
        assert tuple(f.argtypes) == argtypes, name
        assert getattr(lib, name) is f
        assert lib.has(name)
    with pytest.raises(AttributeError):
        lib.ncclNotAFunction  # noqa: B018


def test_version_codes_and_gating():
    assert L.nccl_version_code(2, 8, 4) == 2804
    assert L.nccl_version_code(2, 9, 0) == 20900
    assert L.nccl_version_code(2, 28, 3) == 22803
    L.require_version("ncclAlltoAll", 22800)
    for name, loaded, need in (("ncclAlltoAll", 22703, "2.28.0"), ("ncclGather", 22703, "2.28.0"),
                               ("ncclScatter", 21903, "2.28.0"),
                               ("ncclCommSplit", 21707, "2.18.0"),
                               ("ncclCommRegister", 21810, "2.19.0"),
                               ("ncclMemAlloc", 21810, "2.19.0"),
                               ("ncclRedOpCreatePreMulSum", 21003, "2.11.0"),
                               ("ncclCommInitRankConfig", 21306, "2.14.0"),
                               ("ncclSend", 2604, "2.7.0")):
        with pytest.raises(errors.VersionError) as ei:
            L.require_version(name, loaded)
        msg = str(ei.value)
        assert (name in msg and f">= {need}" in msg
                and ncclpy.ops.format_version(loaded) in msg)
    with pytest.raises(KeyError):
        L.require_version("ncclBogus", 23000)


# -- errors -------------------------------------------------------------------------------

def test_error_strings_and_classes():
    lib = _nccl_or_skip()
    texts = {c: lib.error_string(c) for c in range(9)}
    assert texts[0] == "no error"
    assert "unhandled cuda error" in texts[1]
    assert "invalid argument" in texts[4]
    assert "invalid usage" in texts[5]
    assert all(texts.values())
    for code, cls in ((1, errors.NcclUnhandledCudaError), (2, errors.NcclSystemError),
                      (3, errors.NcclInternalError), (4, errors.NcclInvalidArgument),
                      (5, errors.NcclInvalidUsage), (6, errors.NcclRemoteError),
                      (8, errors.NcclTimeoutError)):
        e = lib.error(code, "ncclSomething")
        assert type(e) is cls and e.code == code and e.call == "ncclSomething"
        assert errors.NCCL_RESULT_NAMES[code] in str(e)
    assert lib.check(0, "x") == 0
    assert lib.check(7, "x", in_progress_ok=True) == 7
    with pytest.raises(errors.NcclInProgress):
        lib.check(7, "x")


def test_last_error_text_from_a_real_failure():
    lib = _nccl_or_skip()
    code = lib.ncclGroupEnd()  # not in a group: NCCL refuses
    assert code == 5
    with pytest.raises(errors.NcclInvalidUsage) as ei:
        lib.check(code, "ncclGroupEnd")
    assert "not in a group" in ei.value.last_error
    assert "ncclGroupEnd failed: ncclInvalidUsage (5)" in str(ei.value)


@pytest.mark.skipif(not NO_GPU, reason="checks the no-driver outcome; a GPU is present")
def test_comm_init_without_a_driver_is_an_unhandled_cuda_error():
    lib = _nccl_or_skip()
    with pytest.raises(errors.NcclUnhandledCudaError) as ei:
        lib.comm_init_rank_config(1, lib.get_unique_id(), 0, Config().to_struct(lib.version))
    assert ei.value.call == "ncclCommInitRankConfig"
    assert "Cuda failure" in ei.value.last_error
    # NCCL returns from this failure with the thread's group depth raised; ncclpy closes it
    assert lib.ncclGroupEnd() == 5, "a failed init left an NCCL group open"
    p = ctypes.c_void_p(0)
    with pytest.raises(errors.NcclUnhandledCudaError):
        lib.check(lib.ncclMemAlloc(ctypes.byref(p), 1024), "ncclMemAlloc")


@pytest.mark.skipif(NO_GPU, reason=f"needs a GPU: {cuda_reason()}")
def test_comm_init_rank_config_world_of_one():  # pragma: no cover - GPU machines
    cupy = _cupy()
    lib = _nccl_or_skip()
    with cupy.cuda.Device(0):
        h, code = lib.comm_init_rank_config(1, lib.get_unique_id(), 0,
                                            Config().to_struct(lib.version))
    assert code == 0 and h
    assert lib.comm_query("ncclCommCount", h) == 1
    assert lib.comm_query("ncclCommUserRank", h) == 0
    lib.check(lib.ncclCommDestroy(h), "ncclCommDestroy")


def test_missing_cupy_names_the_extras():
    r = _run_py("""
        import sys
        sys.path.insert(0, '.')
        import ncclpy, ncclpy._nccl
        try:
            import cupy
            print('CUPY-IMPORTABLE')
        except ImportError:
            pass
        for what in ('get_lib', 'comm'):
            try:
                if what == 'get_lib':
                    ncclpy._nccl.get_lib()
                else:
                    ncclpy.Communicator(1, 0, bytes(128), 0)
            except ncclpy.MissingDependencyError as e:
                assert isinstance(e, ImportError)
                print('MDE', e)
    """, "-S", "-I")
    assert r.returncode == 0, r.stderr
    if "CUPY-IMPORTABLE" in r.stdout:  # pragma: no cover - cupy outside site-packages
        pytest.skip("cupy importable without site-packages")
    lines = [x for x in r.stdout.splitlines() if x.startswith("MDE")]
    assert len(lines) == 2, r.stdout
    for line in lines:
        assert "ncclpy[cu13]" in line and "ncclpy[cu12]" in line and "cupy" in line


# -- Config -------------------------------------------------------------------------------

_VALUES = {"blocking": False, "cga_cluster_size": 2, "min_ctas": 3, "max_ctas": 16,
           "net_name": "Socket", "split_share": True, "traffic_class": 5, "comm_name": "mycomm",
           "collnet_enable": True, "cta_policy": 1, "shrink_share": True, "nvls_ctas": 7,
           "n_channels_per_net_peer": 4, "nvlink_centric_sched": True, "graph_usage_mode": 1,
           "num_rma_ctx": 2, "max_p2p_peers": 8, "graph_stream_ordering": False,
           "launch_order_implicit": True, "num_rma_sig": 4, "rma_eager_init": True,
           "host_cft_mode": 3, "nvls_host_mode": 1}


def test_config_defaults_keep_nccl_defaults():
    s = Config().to_struct()
    assert ctypes.sizeof(NcclConfigStruct) == s.size == 120
    assert s.magic == CONFIG_MAGIC == 0xCAFEBEEF and s.version == CONFIG_VERSION == 23200
    for name, (cname, kind, _) in CONFIG_FIELDS.items():
        v = getattr(s, cname)
        assert v == (None if kind == "str" else CONFIG_UNDEF_INT), name
    assert Config().set_fields() == {}
    assert not Config().nonblocking and Config(blocking=False).nonblocking


@pytest.mark.parametrize("field", sorted(CONFIG_FIELDS))
def test_config_field_by_field(field):
    value = _VALUES[field]
    s = Config(**{field: value}).to_struct(23203)
    base = Config().to_struct()
    for name, (cname, kind, _) in CONFIG_FIELDS.items():
        got = getattr(s, cname)
        if name == field:
            want = value.encode() if kind == "str" else int(value)
            assert got == want
        elif (field, name) == ("min_ctas", "max_ctas"):  # NCCL refuses min with max unset
            assert got == max(64, value)
        else:
            assert got == getattr(base, cname), f"setting {field} changed {cname}"
    raw = bytes(s)
    off = getattr(NcclConfigStruct, CONFIG_FIELDS[field][0]).offset
    if CONFIG_FIELDS[field][1] != "str":
        assert int.from_bytes(raw[off:off + 4], "little", signed=True) == int(value)


@pytest.mark.parametrize("field", sorted(CONFIG_FIELDS))
def test_config_field_version_gate(field):
    need = CONFIG_FIELDS[field][2]
    cfg = Config(**{field: _VALUES[field]})
    cfg.check_version(need)
    with pytest.raises(errors.VersionError) as ei:
        cfg.to_struct(need - 1)
    assert f"Config.{field}" in str(ei.value)
    assert ncclpy.ops.format_version(need) in str(ei.value)


def test_config_size_is_the_loaded_nccls_struct():
    """The versioned size: the end of the last field the loaded NCCL's ncclConfig_t has, so an
    older NCCL copies only the prefix it knows; every set field lies inside it."""
    from ncclpy._nccl.config import struct_size
    assert struct_size(None) == struct_size(23203) == ctypes.sizeof(NcclConfigStruct) == 120
    assert struct_size(22800) == 80 and struct_size(22900) == 88 and struct_size(23100) == 112
    assert struct_size(21400) == 24            # size, magic, version, blocking (+ padding)
    for field, (cname, _kind, need) in CONFIG_FIELDS.items():
        f = getattr(NcclConfigStruct, cname)
        s = Config(**{field: _VALUES[field]}).to_struct(need)
        assert f.offset + f.size <= s.size == struct_size(need), field
        assert s.version == 23200


def test_config_new_fields_refuse_bad_values():
    cases = [({"graph_usage_mode": 3}, errors.ArgumentError, "expected 0, 1 or 2"),
             ({"num_rma_ctx": -1}, errors.ArgumentError, ">= 0"),
             ({"max_p2p_peers": 0}, errors.ArgumentError, "positive"),
             ({"graph_stream_ordering": 0}, errors.ArgumentTypeError, "True, False or None"),
             ({"host_cft_mode": "sometimes"}, errors.ArgumentError, "enable, disable, fallback"),
             ({"host_cft_mode": 0}, errors.ArgumentError, "not a mode"),
             ({"nvls_host_mode": 4}, errors.ArgumentError, "not a mode"),
             ({"nvls_host_mode": True}, errors.ArgumentTypeError, "mode name or int"),
             ({"graph_usage_mode": 2, "graph_stream_ordering": False}, errors.ArgumentError,
              "graph mixing")]
    for kwargs, cls, words in cases:
        with pytest.raises(cls, match=words):
            Config(**kwargs)
    c = Config(graph_stream_ordering=False)
    with pytest.raises(errors.ArgumentError, match="graph_usage_mode=2"):
        c.graph_usage_mode = 2                   # refused on assignment too, nothing changed
    assert c.graph_usage_mode is None
    assert Config(nvls_host_mode="disable").nvls_host_mode == 2 ** 31 - 1
    assert Config(nvls_host_mode=3).nvls_host_mode == 3
    assert Config(host_cft_mode="Fallback").host_cft_mode == 3


def test_config_validation_messages():
    cases = [({"min_ctas": 8, "max_ctas": 4}, errors.ArgumentError, "min_ctas=8"),
             ({"max_ctas": 0}, errors.ArgumentError, "positive"),
             ({"blocking": "no"}, errors.ArgumentTypeError, "Config.blocking"),
             ({"cga_cluster_size": 1.5}, errors.ArgumentTypeError, "expected an int"),
             ({"cga_cluster_size": -1}, errors.ArgumentError, "expected 0..8"),
             ({"cga_cluster_size": 99}, errors.ArgumentError, "clamps"),
             ({"traffic_class": -5}, errors.ArgumentError, "0..255"),
             ({"blocking": 0}, errors.ArgumentTypeError, "got int 0"),
             ({"blokcing": True}, TypeError, "blokcing"),
             ({"comm_name": 3}, errors.ArgumentTypeError, "Config.comm_name"),
             ({"net_name": "a\x00b"}, errors.ArgumentError, "NUL"),
             ({"cta_policy": "fast"}, errors.ArgumentError, "efficiency"),
             ({"cta_policy": 9}, errors.ArgumentError, "CTA policy"),
             ({"traffic_class": -(2 ** 31)}, errors.ArgumentError, "INT_MIN"),
             ({"nvls_ctas": True}, errors.ArgumentTypeError, "nvls_ctas")]
    for kwargs, cls, words in cases:
        with pytest.raises(cls) as ei:
            Config(**kwargs)
        assert words in str(ei.value), (kwargs, str(ei.value))
    assert Config(cta_policy="zero").cta_policy == 2
    import numpy as np
    c = Config(blocking=np.False_, max_ctas=np.int64(8))     # NumPy scalars: one rule
    assert c.blocking is False and c.max_ctas == 8 and type(c.max_ctas) is int
    for field, value, cls, words in (("blocking", "garbage", errors.ArgumentTypeError,
                                      "Config.blocking: expected True, False or None"),
                                     ("min_ctas", 9, errors.ArgumentError, "min_ctas=9"),
                                     ("nvls_ctas", 0, errors.ArgumentError, "positive"),
                                     ("blokcing", True, AttributeError, "no field 'blokcing'")):
        with pytest.raises(cls, match=words):             # checked on assignment too
            setattr(c, field, value)
    assert c.blocking is False and c.min_ctas is None    # a refused assignment changes nothing


# -- groups, streams, work ----------------------------------------------------------------

def test_group_end_runs_when_the_block_raises():
    lib = _nccl_or_skip()
    from ncclpy.comm.execute import group_state
    with pytest.raises(KeyError, match="boom"):
        with ncclpy.group():
            with ncclpy.group():
                assert group_state().depth == 2
            raise KeyError("boom")
    assert group_state().depth == 0
    assert lib.ncclGroupEnd() == 5, "ncclpy left an NCCL group open"


def test_group_end_failure_is_raised_unless_the_block_raised():
    lib = _nccl_or_skip()
    from ncclpy.comm.execute import group_state
    with pytest.raises(errors.NcclInvalidUsage) as ei:
        with ncclpy.group():
            lib.ncclGroupEnd()  # closes NCCL's group behind ncclpy's back
    assert "ncclGroupEnd" in str(ei.value)
    with pytest.raises(ValueError, match="original"):
        with ncclpy.group():
            lib.ncclGroupEnd()
            raise ValueError("original")
    assert group_state().depth == 0


def test_deferred_steps_run_after_the_outermost_group_end():
    _nccl_or_skip()
    from ncclpy.comm.execute import group_state
    seen = []
    with ncclpy.group():
        with ncclpy.group():
            group_state().pending.append(lambda err: seen.append(("inner", err)))
        assert seen == []
    assert seen == [("inner", None)]


def test_stream_handles():
    from ncclpy.comm.streams import as_stream_handle, resolve_stream

    class Proto:
        def __cuda_stream__(self):
            return (0, 0x1234)

    class Bad:
        def __cuda_stream__(self):
            return 5

    class TorchLike:
        cuda_stream = 0x55

    assert as_stream_handle(0) == 0 and as_stream_handle(0x7F00) == 0x7F00
    assert as_stream_handle(Proto()) == 0x1234
    assert as_stream_handle(TorchLike()) == 0x55
    assert resolve_stream(77, [], 0) == 77
    for bad, words in ((True, "bool"), (-1, ">= 0"), ("s", "not a CUDA stream"),
                       (Bad(), "(version, handle)")):
        with pytest.raises(errors.ArgumentTypeError) as ei:
            as_stream_handle(bad)
        assert words in str(ei.value)


def test_cupys_null_stream_is_handle_0():
    from ncclpy.comm.streams import as_stream_handle
    assert as_stream_handle(_cupy().cuda.Stream.null) == 0


def test_default_stream_from_cai_v3():
    from ncclpy.comm.streams import default_stream

    class Cai:
        def __init__(self, stream):
            self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                             "version": 3, "stream": stream}

    assert default_stream([Cai(0xABC)], 0) == 0xABC
    assert default_stream([Cai(1)], 0) == 0      # legacy default stream
    assert default_stream([Cai(2)], 0) == 2      # per-thread default stream


def test_work_from_an_open_group_cannot_be_waited():
    from ncclpy.comm.work import Work
    w = Work(None, 0, 0x10)
    assert not w.is_completed()
    with pytest.raises(errors.NcclpyError, match="outermost group ends"):
        w.wait()
    w._fail(errors.NcclRemoteError(6, "ncclGroupEnd", "peer died"))
    with pytest.raises(errors.NcclRemoteError):
        w.wait()
    assert "failed" in repr(w)


def test_segments_keep_order():
    from ncclpy.comm.execute import segments
    from ncclpy.plan.types import Copy, NcclCall, Scratch
    c1 = Copy(Scratch(0), 0x100, 8)
    a = NcclCall("Send", (0x10, 2, 7, 1))
    b = NcclCall("Recv", (0x20, 2, 7, 1))
    c2 = Copy(0x200, Scratch(8), 8)
    assert segments((c1, a, b, c2)) == [(False, (c1,)), (True, (a, b)), (False, (c2,))]
    assert segments(()) == []
    with pytest.raises(TypeError):
        segments(("nope",))


# -- communicator error paths -------------------------------------------------------------

def test_communicator_argument_errors():
    uid = bytes(128)
    cases = [((0, 0, uid, 0), errors.ArgumentError, "world_size"),
             ((2, 2, uid, 0), errors.ArgumentError, "0 <= rank < 2"),
             ((2, -1, uid, 0), errors.ArgumentError, "rank"),
             ((2, 0, uid[:10], 0), errors.ArgumentError, "128 bytes"),
             ((2, 0, "uid", 0), errors.ArgumentTypeError, "unique id"),
             ((2, 0, uid, -1), errors.ArgumentError, "device"),
             ((2, 0, uid, "0"), errors.ArgumentTypeError, "device"),
             ((2, 0, uid, 0, {"blocking": False}), errors.ArgumentTypeError, "ncclpy.Config")]
    for args, cls, words in cases:
        with pytest.raises(cls) as ei:
            ncclpy.Communicator(*args)
        assert words in str(ei.value), (args, str(ei.value))
    with pytest.raises(errors.ArgumentError, match="timeout"):
        ncclpy.Communicator(1, 0, uid, 0, timeout=0)


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU outcome; a GPU is present")
@pytest.mark.parametrize("config", [None, Config(), Config(blocking=False, comm_name="x")])
def test_communicator_without_a_gpu_says_so(config):
    _nccl_or_skip()
    with pytest.raises(L.CudaUnavailableError) as ei:
        ncclpy.Communicator(1, 0, L.get_lib().get_unique_id(), 0, config)
    msg = str(ei.value)
    assert "no usable CUDA device" in msg and "device=0" in msg and "cuda" in msg.lower()
    assert isinstance(ei.value, errors.NcclpyError)



@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU outcome; a GPU is present")
def test_init_without_a_gpu_fails_before_the_rendezvous():
    """Rank 1 of 2 with nobody listening at the store address: without the early check it
    would retry the connection for the whole timeout; it must fail at once, naming the cause."""
    _nccl_or_skip()
    t0 = time.monotonic()
    with pytest.raises(L.CudaUnavailableError) as ei:
        ncclpy.init("early", timeout=60, rank=1, world_size=2, master_addr="127.0.0.1",
                    master_port=9)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert "ncclpy.init('early')" in msg and "no usable CUDA device" in msg
    assert "did not join the rendezvous" in msg

def test_cupy_nccl_errors_become_ncclpy_errors():
    lib = _nccl_or_skip()
    from ncclpy._nccl import dispatch
    with pytest.raises(lib.cupy_nccl.NcclError):     # CuPy's own error, for real
        lib.cupy_nccl.groupEnd()
    x = ctypes.c_int(0)
    lib.error(lib.ncclCommCount(None, ctypes.byref(x)), "ncclCommCount")  # other text seen
    with pytest.raises(errors.NcclInvalidUsage) as ei:
        dispatch.call_cupy(lib, "ncclGroupEnd", None, lib.cupy_nccl.groupEnd)
    assert ei.value.code == 5 and ei.value.call == "ncclGroupEnd"
    assert "not in a group" in ei.value.last_error
    with pytest.raises(errors.NcclInvalidUsage):
        dispatch.lib_group(lib, "ncclGroupEnd")()
    assert dispatch.lib_group(lib, "ncclGroupStart")() == 0
    assert dispatch.lib_group(lib, "ncclGroupEnd")() == 0


@pytest.mark.skipif(not NO_GPU, reason="checks the no-driver outcome; a GPU is present")
def test_cupy_communicator_takes_the_uid_and_fails_on_cuda_not_on_its_type():
    lib = _nccl_or_skip()
    from ncclpy._nccl import dispatch
    with pytest.raises(lib.cupy_nccl.NcclError) as ei:   # not TypeError: the uid form is right
        dispatch.cupy_init(lib.cupy_nccl, 1, lib.get_unique_id(), 0)
    assert ei.value.status == 1
    assert lib.repair_group_depth() >= 0
    assert lib.ncclGroupEnd() == 5, "NCCL group depth left raised"


def test_uid_forms():
    from ncclpy._nccl.dispatch import uid_bytes
    raw = bytes(range(128))
    assert uid_bytes(raw) == raw == uid_bytes(bytearray(raw)) == uid_bytes(memoryview(raw))
    signed = tuple(b - 256 if b > 127 else b for b in raw)     # CuPy <= 13 form
    assert uid_bytes(signed) == raw
    with pytest.raises(errors.ArgumentTypeError):
        uid_bytes(("a",) * 128)
