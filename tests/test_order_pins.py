"""ncclpy.order's run-by-run evaluation (``Prediction.spans``, the native fold) against the
per-element maps and the reference's arithmetic, and ``Pins``: NCCL_ALGO / NCCL_PROTO read as
NCCL's parseList reads them (src/graph/tuning.cc:54-130 at v2.28.9-1), the channel count as
connect.cc sets it, what they pin on a GPU and what the CPU backend runs."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ncclpy.semantics import numerics as nm
from ncclpy.order import Choice, OrderConfig, PinError, Pins, predict
from ncclpy.order.arith import Arith, native_fold
from ncclpy.order.pins import NCCL_ALGOS, NCCL_PROTOS, c_strtoll, no_algorithm_text, parse_list
from ncclpy.semantics.reference import reduce_arrays


def _config(rng: random.Random) -> OrderConfig:
    n = rng.randint(1, 7)
    coll = rng.choice(["all_reduce", "reduce_scatter", "reduce"])
    algo = "tree" if coll == "all_reduce" and rng.random() < 0.3 else "ring"
    proto = rng.choice(["ll", "ll128", "simple"])
    buff = {"simple": 4096 * rng.randint(1, 3), "ll": 1024 * rng.randint(1, 3),
            "ll128": 16384}[proto]
    k = rng.randint(1, 4)
    return OrderConfig.make(coll, n, rng.choice([1, 7, rng.randint(8, 500),
                                                 rng.randint(500, 30000)]),
                            dtype=rng.choice(["float32", "float16", "float64", "int8"]),
                            algo=algo, proto=proto, root=rng.randrange(n), channels=k,
                            rings=[rng.sample(range(n), n) for _ in range(k)],
                            buffsizes={proto: buff})


@pytest.mark.parametrize("seed", range(3))
def test_spans_tile_the_output_with_each_elements_fold(seed):
    rng = random.Random(seed)
    for _ in range(50):
        cfg = _config(rng)
        pred = predict(cfg)
        for r in range(cfg.nranks):
            spans, m = pred.spans(r), pred.order_map(r)
            assert (spans is None) == (m is None) == (not pred.defined(r))
            if spans is None:
                continue
            pos = 0
            for lo, hi, expr in spans:
                assert lo == pos < hi
                pos = hi
                for e in {lo, hi - 1, (lo + hi) // 2, rng.randrange(lo, hi)}:
                    assert m.expr(e) == expr, (cfg.describe(), r, e)
            assert pos == cfg.count
            # maximal runs: two neighbouring spans of one channel never share a fold
            # unless the map's runs say so too
            assert len(spans) >= len(m.runs())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_the_native_fold_gives_the_references_bits_nan_payloads_included(dtype, op):
    rng = np.random.default_rng(7)
    items = [rng.standard_normal(4000) * 10.0 ** rng.integers(-30, 30, 4000) for _ in range(4)]
    items = [x.astype(dtype) for x in items]
    items[1][:50] = np.inf
    items[2][25:75] = -np.inf                     # inf - inf: NaN where they meet
    items[3][100] = np.nan
    ar = Arith(dtype, op, 4)
    got = ar.fold(items)
    want = reduce_arrays(items, op, dtype, world_size=4)
    assert np.array_equal(nm.as_bits(got, dtype), nm.as_bits(want, dtype))
    clean = [x[200:] for x in items]
    assert native_fold(clean, op, np.dtype(dtype).type) is not None
    assert native_fold(items, op, np.dtype(dtype).type) is None     # a NaN: the reference's


def test_outputs_of_some_ranks_and_the_issue_example():
    env = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1",
           "NCCL_MAX_NCHANNELS": "1"}
    cfg = Pins.from_env(env).cpu_choice("all_reduce").config("all_reduce", 3, 12)
    ins = [np.full(12, 2.0 ** 30, np.float32), np.full(12, -2.0 ** 30, np.float32),
           np.ones(12, np.float32)]
    out = predict(cfg).outputs(ins)
    assert out[0].tolist() == [0.0] * 8 + [1.0] * 4 == out[2].tolist()
    assert out[1] is not out[0]
    assert predict(cfg).outputs(ins, ranks=[1])[0] is None


# -- NCCL_ALGO / NCCL_PROTO ---------------------------------------------------------------------
def _on(table, func, names):
    return [n for n in names if table[func][n]]


def test_parse_list_reads_as_nccl_does():
    d = parse_list("", NCCL_PROTOS)
    assert d["AllReduce"] == {"LL": 1, "LL128": 2, "Simple": 1}      # tuning.cc:392
    t = parse_list("ring", NCCL_ALGOS)
    assert all(_on(t, f, NCCL_ALGOS) == ["Ring"] for f in t)
    t = parse_list("^RING,tree", NCCL_ALGOS)
    assert _on(t, "AllReduce", NCCL_ALGOS) == ["CollNetDirect", "CollNetChain", "NVLS",
                                                "NVLSTree", "PAT"]
    t = parse_list("ring;allreduce:tree", NCCL_ALGOS)
    assert _on(t, "AllReduce", NCCL_ALGOS) == ["Tree"]
    assert _on(t, "Reduce", NCCL_ALGOS) == ["Ring"]
    t = parse_list("^LL128;allreduce:LL128", NCCL_PROTOS)           # the example of :52-53
    assert _on(t, "AllReduce", NCCL_PROTOS) == ["LL128"]
    assert _on(t, "Broadcast", NCCL_PROTOS) == ["LL", "Simple"]


@pytest.mark.parametrize("text, words", [
    ("ring;tree", 'All entries except the first must have a prefix: "ring;tree"'),
    ("rings", 'Unrecognized element token "rings" when parsing "rings"'),
    ("allreduc:ring", 'Unrecognized prefix token "allreduc" when parsing "allreduc:ring"'),
])
def test_what_nccl_refuses_at_init_is_refused_with_its_words(text, words):
    with pytest.raises(PinError) as e:
        parse_list(text, NCCL_ALGOS)
    assert str(e.value) == words
    with pytest.raises(PinError) as e:
        Pins.from_env({"NCCL_ALGO": text})
    assert str(e.value) == f"NCCL_ALGO={text}: {words}"


@pytest.mark.parametrize("env, want", [
    ({}, 1), ({"NCCL_MIN_NCHANNELS": "4"}, 4), ({"NCCL_MAX_NCHANNELS": "0"}, 1),
    ({"NCCL_MIN_NCHANNELS": "3", "NCCL_MAX_NCHANNELS": "3"}, 3),
    ({"NCCL_MIN_NRINGS": "2"}, 2), ({"NCCL_MIN_NRINGS": "2", "NCCL_MIN_NCHANNELS": "5"}, 5),
    ({"NCCL_MIN_NCHANNELS": "100"}, 64), ({"NCCL_MIN_NCHANNELS": "0x4"}, 4),
])
def test_the_cpu_backends_channels_are_connect_ccs(env, want):
    assert Pins.from_env(env).cpu_choice("all_reduce").channels == want


@pytest.mark.parametrize("text, want", [
    ("4x", (4, "it stops at 'x'")), ("010", (8, "")), ("0x1f", (31, "")), ("0X1F", (31, "")),
    ("-0x10", (-16, "")), ("0x", (0, "it stops at 'x'")), ("0xg", (0, "it stops at 'xg'")),
    ("08", (0, "it stops at '8'")), ("0", (0, "")), ("  +7", (7, "")), ("", (0, "no digits")),
    ("x", (0, "no digits")), ("12 ", (12, "")), ("-", (0, "no digits")),
])
def test_strtoll_base_0(text, want):
    assert c_strtoll(text) == want


@pytest.mark.parametrize("env, want", [
    ({}, None), ({"NCCL_MAX_NCHANNELS": "1"}, 1), ({"NCCL_MAX_CTAS": "1"}, 1),
    ({"NCCL_MAX_NCHANNELS": "2"}, None),
    ({"NCCL_MIN_NCHANNELS": "2"}, None), ({"NCCL_MIN_NCHANNELS": "2",
                                           "NCCL_MAX_NCHANNELS": "2"}, 2),
    ({"NCCL_MIN_NCHANNELS": "4", "NCCL_MAX_NCHANNELS": "2"}, 4),
])
def test_the_channels_the_environment_decides_on_any_machine(env, want):
    p = Pins.from_env(env)
    assert p.pinned_channels() == want
    for found in (1, 2, 3, 8, 32):                      # connect.cc:490-491 whatever was found
        assert want is None or p.comm_channels(found) == want
    assert Pins.from_env({}).min_channels == 0 and Pins.from_env({}).max_channels == 64


def test_numbers_are_read_as_strtoll_reads_them_and_the_reading_is_noted():
    p = Pins.from_env({"NCCL_MIN_NCHANNELS": "2ch", "NCCL_BUFFSIZE": "65536B"})
    assert p.min_channels == 2 and dict(p.buffsizes) == {"simple": 65536}
    assert len(p.notes) == 2 and "NCCL_MIN_NCHANNELS=2ch" in p.notes[0]


@pytest.mark.parametrize("env, coll, want", [
    ({"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}, "all_reduce", ("ring", "simple")),
    ({"NCCL_ALGO": "tree", "NCCL_PROTO": "ll"}, "all_reduce", ("tree", "ll")),
    ({"NCCL_PROTO": "LL128"}, "reduce", ("ring", "ll128")),   # Reduce has only Ring
    ({"NCCL_PROTO": "Simple"}, "all_reduce", None),           # Tree, Ring, NVLS... enabled
    ({"NCCL_ALGO": "Ring"}, "all_reduce", None),              # LL128: the platform decides
    ({"NCCL_ALGO": "Ring", "NCCL_PROTO": "^LL"}, "all_reduce", None),
    ({"NCCL_ALGO": "PAT", "NCCL_PROTO": "Simple"}, "reduce_scatter", None),   # not modelled
])
def test_what_the_environment_pins_on_a_gpu(env, coll, want):
    algo, proto, why = Pins.from_env(env).pinned(coll)
    if want is None:
        assert algo is None and proto is None and why
    else:
        assert (algo, proto, why) == (*want, "")


def test_what_the_cpu_backend_runs():
    c = Pins.from_env({}).cpu_choice("all_reduce")
    assert (c.algo, c.proto, c.channels, c.buffsizes) == ("ring", "simple", 1, ())
    assert c.why == ("Ring, the CPU backend's choice among Tree, Ring; Simple, the CPU "
                     "backend's default; 1 channel (the CPU backend's one ring)")
    c = Pins.from_env({"NCCL_ALGO": "ring", "NCCL_PROTO": "ll", "NCCL_MAX_NCHANNELS": "1"}
                      ).cpu_choice("all_reduce")
    assert c.why == ("NCCL_ALGO pins Ring; NCCL_PROTO pins LL; 1 channel (NCCL_MIN/MAX_NCHANNELS, "
                     "NCCL_MIN/MAX_CTAS)")
    c = Pins.from_env({"NCCL_MIN_NCHANNELS": "2"}).cpu_choice("reduce")
    assert c.why == ("Ring, NCCL's only algorithm for reduce; Simple, the CPU backend's "
                     "default; 2 channels (NCCL_MIN/MAX_NCHANNELS, NCCL_MIN/MAX_CTAS)")
    assert Pins.from_env({"NCCL_ALGO": "^ring"}).cpu_choice("all_reduce").algo == "tree"
    assert Pins.from_env({"NCCL_PROTO": "^simple"}).cpu_choice("reduce").proto == "ll"
    assert Pins.from_env({"NCCL_PROTO": "^simple,ll"}).cpu_choice("reduce").proto == "ll128"
    pat = Pins.from_env({"NCCL_ALGO": "PAT"}).cpu_choice("reduce_scatter")
    assert pat.algo == "ring" and pat.proto == "simple" and "not NCCL's bits" in pat.why
    pat = Pins.from_env({"NCCL_ALGO": "PAT,ring", "NCCL_PROTO": "LL"}).cpu_choice("all_gather")
    assert (pat.algo, pat.proto) == ("ring", "ll") and pat.why.startswith("NCCL_ALGO pins Ring")
    c = Pins.from_env({"NCCL_LL_BUFFSIZE": "4096", "NCCL_PROTO": "LL"}).cpu_choice("all_reduce")
    assert isinstance(c, Choice) and c.config("all_reduce", 2, 10).buffsize == 4096


@pytest.mark.parametrize("env, coll", [({"NCCL_ALGO": "tree"}, "reduce_scatter"),
                                       ({"NCCL_ALGO": "tree"}, "reduce"),
                                       ({"NCCL_ALGO": "tree"}, "broadcast"),
                                       ({"NCCL_ALGO": "PAT"}, "all_reduce"),
                                       ({"NCCL_ALGO": "PAT", "NCCL_PROTO": "LL"},
                                        "reduce_scatter"),             # PAT: Simple only
                                       ({"NCCL_ALGO": "NVLS"}, "all_reduce"),   # no NVLS here
                                       ({"NCCL_ALGO": "CollNetDirect"}, "all_gather"),
                                       ({"NCCL_PROTO": "^ll,ll128,simple"}, "all_reduce")])
def test_nothing_enabled_is_ncclss_no_algorithm_error(env, coll):
    with pytest.raises(PinError) as e:
        Pins.from_env(env).cpu_choice(coll, "ncclFloat32")
    assert str(e.value) == no_algorithm_text(coll, "ncclFloat32", env.get("NCCL_ALGO"),
                                             env.get("NCCL_PROTO"))
    assert str(e.value).startswith("Error : no algorithm/protocol available for function ")
    for var in env:
        assert f"{var} was set to {env[var]}." in str(e.value)
    with pytest.raises(PinError) as e:
        Pins.from_env(env, version=23007).cpu_choice(coll, "ncclFloat32")
    assert str(e.value).startswith("No algorithm/protocol available for function ")


def test_pat_is_off_for_premultiplied_reduce_scatters_and_where_nccl_pat_enable_is_0():
    p = Pins.from_env({"NCCL_ALGO": "PAT"})
    assert p.cpu_choice("reduce_scatter").algo == "ring"            # PAT: Ring's order
    with pytest.raises(PinError):                                   # enqueue.cc:1805-1806
        p.cpu_choice("reduce_scatter", premul=True)
    assert p.cpu_choice("all_gather", premul=True).algo == "ring"
    with pytest.raises(PinError):                                   # tuning.cc:201-209
        Pins.from_env({"NCCL_ALGO": "PAT", "NCCL_PAT_ENABLE": "0"}).cpu_choice("all_gather")
    c = Pins.from_env({"NCCL_ALGO": "PAT", "NCCL_PAT_ENABLE": "1"}, version=23007)
    assert c.cpu_choice("all_gather").version == 23007
    assert c.cpu_choice("all_gather").config("all_reduce", 3, 8).version == 23007


def test_an_empty_variable_is_set_for_the_message_and_unset_for_the_parse():
    p = Pins.from_env({"NCCL_ALGO": "", "NCCL_PROTO": ""})
    assert p.cpu_choice("all_reduce").algo == "ring"
    assert no_algorithm_text("reduce", "ncclInt8", "", None) == (
        "Error : no algorithm/protocol available for function Reduce with datatype ncclInt8. "
        "NCCL_ALGO was set to .")


@pytest.mark.parametrize("text, words", [
    (";ring", 'All entries except the first must have a prefix: ";ring"'),
    ("ring;:", 'All entries except the first must have a prefix: "ring;:"'),
    (":", 'an entry of colons only makes NCCL read a null pointer'),
])
def test_parse_list_edge_cases_as_strtok_gives_them(text, words):
    with pytest.raises(PinError) as e:
        parse_list(text, NCCL_ALGOS)
    assert words in str(e.value)
    assert parse_list("ring;;allreduce:tree", NCCL_ALGOS)["AllReduce"]["Tree"] == 1
    assert parse_list("ring:", NCCL_ALGOS)["Reduce"]["Tree"] == 0     # "ring:" is "ring"


def test_a_one_rank_communicator_parses_nothing():
    assert Pins.from_env({"NCCL_ALGO": "bogus"}, nranks=1).cpu_choice("all_reduce").algo == "ring"
    with pytest.raises(PinError):
        Pins.from_env({"NCCL_ALGO": "bogus"}, nranks=2)


def test_nccl_proto_is_parsed_before_nccl_algo():
    with pytest.raises(PinError) as e:
        Pins.from_env({"NCCL_ALGO": "bogus", "NCCL_PROTO": "bogus"})
    assert str(e.value).startswith("NCCL_PROTO=bogus: ")


@pytest.mark.parametrize("env, want", [
    ({"NCCL_MAX_NCHANNELS": "-2"}, (0, 64)), ({"NCCL_MIN_NRINGS": "4",
                                              "NCCL_MIN_NCHANNELS": "-2"}, (4, 64)),
    ({"NCCL_MIN_NCHANNELS": "99999999999999999999"}, (0, 64)),
    ({"NCCL_MIN_NCHANNELS": "4294967298"}, (2, 64)),
    ({"NCCL_MIN_NCHANNELS": "2147483648"}, (0, 64)),       # INT_MIN as an int: below 0
    ({"NCCL_MIN_NCHANNELS": "2147483647"}, (64, 64)),
])
def test_unset_out_of_range_and_int_values_as_nccl_reads_them(env, want):
    p = Pins.from_env(env)
    assert (p.min_channels, p.max_channels) == want
    assert Pins.from_env({"NCCL_BUFFSIZE": "-2"}).buffsizes == ()


def test_cta_limits_and_the_version_bound_the_channels():
    p = Pins.from_env({"NCCL_MIN_NCHANNELS": "4", "NCCL_MAX_NCHANNELS": "4",
                       "NCCL_MIN_CTAS": "8"})
    assert p.cpu_choice("all_reduce").channels == 8 == p.pinned_channels()
    assert Pins.from_env({"NCCL_MAX_CTAS": "3", "NCCL_MIN_NCHANNELS": "2"}).comm_channels(8) == 3
    assert Pins.from_env({"NCCL_MIN_NCHANNELS": "50"}, version=22403).min_channels == 32


def test_the_process_environment_reads_the_conf_file_under_it_once(tmp_path, monkeypatch):
    from ncclpy.order import ncclenv
    conf = tmp_path / "nccl.conf"
    conf.write_text("# a comment\nNCCL_ALGO=tree\nNCCL_PROTO=LL\nNCCL_MIN_NCHANNELS=3\n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(conf))
    monkeypatch.setenv("NCCL_PROTO", "Simple")                 # the environment wins
    for var in ("NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NRINGS"):
        monkeypatch.delenv(var, raising=False)
    ncclenv.forget_params()
    try:
        c = Pins.from_env().cpu_choice("all_reduce")
        assert (c.algo, c.proto, c.channels) == ("tree", "simple", 3)
        monkeypatch.setenv("NCCL_MIN_NCHANNELS", "5")           # cached: NCCL never rereads
        assert Pins.from_env().cpu_choice("all_reduce").channels == 3
        monkeypatch.setenv("NCCL_ALGO", "ring")                 # parsed at each init
        assert Pins.from_env().cpu_choice("all_reduce").algo == "ring"
    finally:
        ncclenv.forget_params()


def test_the_no_algorithm_warning_is_worded_anew_from_2_30_3_exactly():
    """v2.30.3-1 reworded the WARN (enqueue.cc:2063 in v2.30.7-1): that version says "No
    algorithm", the one before it "Error : no algorithm"."""
    new = no_algorithm_text("reduce", "ncclInt8", "tree", None, version=23003)
    old = no_algorithm_text("reduce", "ncclInt8", "tree", None, version=23002)
    assert new == ("No algorithm/protocol available for function Reduce with datatype "
                   "ncclInt8. NCCL_ALGO was set to tree.")
    assert old == "Error : no" + new[2:]


def test_ctas_default_to_one_and_every_channel_unless_set_to_a_positive_number():
    """NCCL_MIN_CTAS / NCCL_MAX_CTAS unset, 0 or negative: NCCL's defaults, 1 and MAXCHANNELS
    (init.cc:1661-1680); a positive value is taken (the maximum capped at MAXCHANNELS)."""
    p = Pins.from_env({})
    assert (p.min_ctas, p.max_ctas) == (1, p.max_channels) == (1, 64)
    for bad in ("0", "-3"):
        p = Pins.from_env({"NCCL_MIN_CTAS": bad, "NCCL_MAX_CTAS": bad})
        assert (p.min_ctas, p.max_ctas) == (1, 64)
    p = Pins.from_env({"NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "500"})
    assert (p.min_ctas, p.max_ctas) == (2, 64)
