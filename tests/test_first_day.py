"""A first day's surprises (issue 22), each pinned: 64-bit pointers and counts, init()'s own
argument errors before the GPU check, the no-GPU error in ``ncclpy info``'s words."""
from __future__ import annotations

import os

import pytest

import ncclpy
from ncclpy import Buffer
from ncclpy.buffers.buffer import BufferSpec
from ncclpy.comm.resolver import Resolver
from ncclpy.errors import ArgumentError, ArgumentTypeError, CudaUnavailableError
from ncclpy.plan.types import PlanContext


@pytest.mark.parametrize("args, words", [
    ((2 ** 64, 4, "float32", 0), "ptr is 18446744073709551616; expected an int <= "),
    ((0x1000, 2 ** 64 + 5, "float32", 0), "count is 18446744073709551621"),
    ((2 ** 64 - 8, 4, "float32", 0), "past the 64-bit address space"),
    ((0x1000, 2 ** 62, "float64", 0), "past the 64-bit address space"),
    ((0x1000, 4, "float32", 2 ** 40), "device is 1099511627776"),
])
def test_buffer_refuses_what_does_not_fit_64_bits(args, words):
    with pytest.raises(ArgumentError, match="Buffer: ") as ei:
        Buffer(*args)
    assert words in str(ei.value)


def test_the_largest_buffer_that_fits_is_accepted():
    b = Buffer(2 ** 64 - 16, 4, "float32", 0)          # ends exactly at 2**64
    assert b.ptr + b.count * 4 == 2 ** 64


def test_planners_refuse_a_span_past_2_64_and_counts_past_size_t():
    r = Resolver(PlanContext(0, 2))
    with pytest.raises(ArgumentError, match="sendbuf at ptr 0xfffffffffffffff8 with 4 elements "
                                            "ends past the 64-bit address space"):
        r.resolve("all_reduce", 0, BufferSpec(2 ** 64 - 8, 4, "float32", 0), None, ("sum",))
    x = Buffer(0x100000, 8, "float32", 0)
    with pytest.raises(ArgumentError, match=r"send_counts\[1\] is 18446744073709551621"):
        r.resolve("all_to_all", 0, x, Buffer(0x200000, 8, "float32", 0),
                  ([4, 2 ** 64 + 5], [4, 4]))


@pytest.mark.parametrize("kwargs, cls, words", [
    ({"config": "x"}, ArgumentTypeError, "config must be an ncclpy.Config or None, got 'x'"),
    ({"uid_exchange": "bogus"}, ArgumentError, "uid_exchange: expected one of store, mpi, auto, "
                                               "got 'bogus'"),
    ({"timout": 1}, ArgumentTypeError, "unexpected keyword argument 'timout'; did you mean "
                                       "'timeout'?"),
    ({"name": ""}, ArgumentTypeError, "name must be a non-empty str"),
])
def test_init_checks_its_own_arguments_before_looking_for_a_gpu(kwargs, cls, words):
    with pytest.raises(cls) as ei:
        ncclpy.init(**kwargs)
    assert words in str(ei.value)
    assert not isinstance(ei.value, CudaUnavailableError)


def test_init_checks_the_uid_exchange_variable_first(monkeypatch):
    monkeypatch.setenv("NCCLPY_UID_EXCHANGE", "carrier-pigeon")
    with pytest.raises(ArgumentError, match="NCCLPY_UID_EXCHANGE: expected one of store, mpi, "
                                            "auto, got 'carrier-pigeon'"):
        ncclpy.init()


def test_no_gpu_error_is_public_and_speaks_like_ncclpy_info():
    from ncclpy.info import no_gpu_reason
    why = no_gpu_reason()
    if not why:
        pytest.skip("this machine has a usable GPU: the no-GPU error cannot be seen here")
    if why.startswith("CuPy is not"):
        pytest.skip("CuPy is not installed: init() stops earlier, at MissingDependencyError")
    assert ncclpy.CudaUnavailableError is CudaUnavailableError
    assert CudaUnavailableError.__module__ == "ncclpy.errors"
    with pytest.raises(CudaUnavailableError) as ei:
        ncclpy.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1)
    reason = why.split(";")[0]
    assert f"no usable CUDA device ({reason})" in str(ei.value), (str(ei.value), why)
    if "driver" in reason:
        assert "insufficient" not in str(ei.value)
    assert os.environ.get("NCCLPY_UID_EXCHANGE") is None


def _sleep(rank: int) -> None:
    import time
    time.sleep(30)


def test_spawn_refuses_what_it_cannot_pickle_and_a_foreign_master_addr():
    from ncclpy.errors import LaunchError
    with pytest.raises(ArgumentTypeError, match=r"^fn: .*<lambda> cannot be sent to the children: "
                                                r"start_method='spawn' pickles it"):
        ncclpy.spawn(lambda r: None, 2)
    with pytest.raises(ArgumentTypeError, match=r"^args: tuple cannot be sent"):
        ncclpy.spawn(_sleep, 2, args=(lambda: 0,))
    with pytest.raises(ArgumentError, match=r"^master_addr 8\.8\.8\.8: not an address of this "
                                            r"machine"):
        ncclpy.spawn(_sleep, 2, master_addr="8.8.8.8")
    with pytest.raises(LaunchError, match=r"timeout=1 s passed with ranks 0, 1 still running"):
        ncclpy.spawn(_sleep, 2, timeout=1)


def test_tcpstore_takes_torchs_positional_form_and_says_what_wait_wants():
    import datetime
    from ncclpy.store import TCPStore
    server = TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=5))
    try:
        assert server.server is not None and server.server.limits.max_clients >= 4 * 3 + 64
        client = TCPStore("127.0.0.1", server.server.port, 3, False, timeout=5)
        try:
            client.set("k", b"v")
            assert server.get("k") == b"v"
            with pytest.raises(ArgumentTypeError, match=r"^wait: keys must be a key or a list of "
                                                        r"keys \(str or bytes\), got 5 \(int\); "
                                                        r"the timeout is the second argument"):
                client.wait(5)
            with pytest.raises(ArgumentTypeError, match=r"^wait: keys\[1\] must be str or bytes"):
                client.wait(["k", 7])
            client.wait(["k"], 1)
        finally:
            client.close()
        with pytest.raises(ArgumentError, match="world_size: expected None or an int >= 1"):
            TCPStore("127.0.0.1", 0, 0, True)
    finally:
        server.server.close()
        server.close()


def test_init_docstring_names_every_keyword_a_torch_user_needs():
    doc = ncclpy.init.__doc__
    for word in ("``store``", "``token``", "``uid_exchange``", "``from_torch``", "``config``",
                 "``timeout``", "``checked``", "``watchdog``"):
        assert word in doc, word
    from ncclpy.comm.startup import INIT_KEYWORDS
    for key in INIT_KEYWORDS:                 # every keyword init() passes on is documented
        assert f"``{key}``" in doc, key


def test_object_collectives_say_when_the_store_refuses_the_result():
    """all_gather_object's joined result larger than the store's values may be: every rank
    raises, at once, saying so (no rank waits out its timeout: 300 s here, so HANG tells)."""
    import threading
    import time
    from ncclpy.comm.objects import ObjectExchange
    from ncclpy.store import StoreServer, TCPStore
    from wait_util import HANG
    srv = StoreServer("127.0.0.1", 0, limits={"max_value_size": 4096}).start()
    out: dict = {}

    def rank(r: int) -> None:
        store = TCPStore("127.0.0.1", srv.port, timeout=10 * HANG)
        ex = ObjectExchange(store, r, 3, "big/obj", 10 * HANG)
        try:
            ex.all_gather(bytes(2000))                # each fits; the three together do not
        except ArgumentError as e:
            out[r] = str(e)
        out[(r, "next")] = ex.broadcast(r if r == 0 else None, 0)   # still in step
        store.close()
    t0 = time.monotonic()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(HANG)
    finally:
        srv.close()
    assert time.monotonic() - t0 < HANG
    for r in range(3):
        assert out[r].startswith("all_gather_object: the store refused "), out
        assert out[(r, "next")] == 0
