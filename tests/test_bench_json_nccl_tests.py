"""``python -m bench -J`` against a JSON file nccl-tests 2.19.6 wrote, key by key.

The reference files (tests/data/nccl_tests_2.19.6/) come from nccl-tests' own writer
(src/util.cu compiled unchanged, driven by driver.cu: see its README).  Ours must have every key
they have, in their order, with the same JSON types and nesting (a double nccl-tests writes
with ``%lf`` is a number in ours too), with and without ``-I``; ncclpy's additions are under one
key of their own, ``ncclpy``.  The deliberate differences (bench/schema.json's description) are
in values, not in structure.  nccl-tests' own reader of its per-iteration JSON
(tools/analyze_perf_json.py, from the same tag) reads ours unchanged.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest

from module_run import run_module

from bench import output
from bench.output import Row, Side

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "data" / "nccl_tests_2.19.6"
SCHEMA = json.loads((ROOT / "bench" / "schema.json").read_text())
pytestmark = pytest.mark.timeout(180)

#: the one key ncclpy adds to nccl-tests' document
EXTENSION = "ncclpy"


def _fixture(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def _jtype(x: Any) -> str:
    """The JSON type a reader sees (an int is not a double: nccl-tests' ``%lf`` always writes
    a decimal point, json reads it as a float)."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    return {int: "int", float: "float", str: "str", list: "list", dict: "dict"}[type(x)]


def shape_diff(ours: Any, theirs: Any, path: str = "$") -> List[str]:
    """Where ``ours`` is not built like ``theirs``: keys (names and order), JSON types,
    nesting; a list's every item is held against the reference's first item.  The top-level
    ``ncclpy`` key is ours alone and left out."""
    if _jtype(ours) != _jtype(theirs):
        return [f"{path}: {_jtype(ours)} where nccl-tests writes {_jtype(theirs)}"]
    if isinstance(theirs, dict):
        keys = [k for k in ours if not (path == "$" and k == EXTENSION)]
        if keys != list(theirs):
            return [f"{path}: keys {keys} where nccl-tests writes {list(theirs)}"]
        return [d for k in theirs for d in shape_diff(ours[k], theirs[k], f"{path}.{k}")]
    if isinstance(theirs, list) and theirs:
        return [d for i, x in enumerate(ours) for d in shape_diff(x, theirs[0], f"{path}[{i}]")]
    return []


def _values_like_nccl_tests(doc: dict) -> None:
    """The values whose spelling nccl-tests fixes: the version, jsonBool's strings, the
    ``%6i`` root, TimeTest's empty experiment name, the time format."""
    assert doc["version"] == 3
    for k in ("blocking_collectives", "per_iter_timing", "parallel_init"):
        assert doc["config"][k] in ("true", "false"), k
    for r in doc["results"]:
        assert re.fullmatch(r" *-?\d+", r["root"]) and len(r["root"]) >= 6, r["root"]
        assert r["experiment_name"] == ""
    for k in ("start_time", "end_time"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", doc[k]), doc[k]
    assert doc["average_bus_bandwidth"]["okay"] in ("true", "false", "unchecked")


def _validate(doc: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, SCHEMA)


def _bench(tmp_path: Path, *extra: str, name: str = "r.json") -> dict:
    js = tmp_path / name
    cp = run_module("bench", "all_reduce", "--backend", "ncclpy", "--device", "cpu", "--nproc",
                    "2", "-b", "8", "-e", "32", "-f", "2", "-n", "4", "-w", "1", "-c", "1",
                    "-q", "-J", str(js), *extra, timeout=150)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    return json.loads(js.read_text())


# ------------------------------------------------------------------------ the reference files
def test_fixture_provenance_matches_the_script():
    """The README says which util.cu made the files; make_fixture.sh checks out exactly that
    (tag, commit, util.cu's blob id) before it builds."""
    script = (FIX / "make_fixture.sh").read_text()
    readme = (FIX / "README.md").read_text()
    got = {k: re.search(rf"^{k}=(\S+)", script, re.M).group(1)
           for k in ("TAG", "TAG_COMMIT", "UTIL_BLOB")}
    assert got["TAG"] == "v2.19.6" and re.fullmatch(r"[0-9a-f]{40}", got["UTIL_BLOB"])
    for v in got.values():
        assert f"`{v}`" in readme, v
    assert ("nccl-tests 2.19.6's util.cu compiled unchanged, driven by driver.cu with stub "
            "device queries; values are the driver's, structure is nccl-tests'") in \
        " ".join(readme.split())
    assert "jsonOutputInit" in (FIX / "driver.cu").read_text()


def test_reference_files_are_nccl_tests_layout():
    """What the tests below hold ours against: nccl-tests' version 3 with its per-iteration
    objects right after each side only with -I, and bench/schema.json describes it (ncclpy's
    own key aside)."""
    plain, per_iter = _fixture("all_reduce_perf.json"), _fixture("all_reduce_perf_per_iter.json")
    for doc in (plain, per_iter):
        _values_like_nccl_tests(doc)
        assert list(doc) == ["version", "start_time", "args", "env", "nccl_version", "config",
                             "results", "out_of_bounds", "average_bus_bandwidth", "errors",
                             "end_time"]
        assert list(doc["config"])[-5:] == ["blocking_collectives", "per_iter_timing",
                                            "per_iter_skip", "parallel_init", "devices"]
    assert list(plain["results"][0]) == ["size", "count", "type", "redop", "root",
                                         "out_of_place", "in_place", "actual_iterations",
                                         "experiment_name"]
    assert list(per_iter["results"][0])[5:9] == ["out_of_place", "out_of_place_per_iter",
                                                 "in_place", "in_place_per_iter"]
    assert plain["errors"] == [""]                  # ncclGetLastError: "" when none
    jsonschema = pytest.importorskip("jsonschema")
    schema = dict(SCHEMA, required=[k for k in SCHEMA["required"] if k != EXTENSION])
    for doc in (plain, per_iter):
        jsonschema.validate(doc, schema)


def test_shape_diff_finds_what_a_reader_would_trip_on():
    """The comparison itself can fail: an int for a double, a missing or moved key, a key
    nccl-tests does not write."""
    ref = _fixture("all_reduce_perf.json")
    assert shape_diff(json.loads(json.dumps(ref)), ref) == []
    bad = json.loads(json.dumps(ref))
    bad["results"][1]["out_of_place"]["time"] = 11
    bad["config"]["extra"] = 1
    bad["results"][0]["in_place"] = dict(reversed(list(bad["results"][0]["in_place"].items())))
    diffs = shape_diff(bad, ref)
    assert any(d.startswith("$.results[1].out_of_place.time: int") for d in diffs), diffs
    assert any(d.startswith("$.config: keys") for d in diffs), diffs
    assert any(d.startswith("$.results[0].in_place: keys") for d in diffs), diffs


# ------------------------------------------------------------------------ ours, through the CLI
def test_bench_json_matches_nccl_tests_key_by_key(tmp_path):
    """A real 2-rank run on the CPU backend, -c 1, no -I: nccl-tests' document exactly, plus
    ``ncclpy``; the schema holds."""
    doc = _bench(tmp_path)
    ref = _fixture("all_reduce_perf.json")
    assert shape_diff(doc, ref) == []
    assert list(doc)[-1] == EXTENSION
    _values_like_nccl_tests(doc)
    _validate(doc)
    assert [r["size"] for r in doc["results"]] == [8, 16, 32]
    assert doc["config"]["per_iter_timing"] == "false" and doc["config"]["per_iter_skip"] == 0
    assert doc["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert doc["errors"] == [""]
    assert doc["ncclpy"]["unalign"] == 0 and doc["ncclpy"]["series"] == ["ncclpy"]
    assert [{k: r[k] for k in ref["results"][0]} for r in doc["ncclpy"]["results"]] == \
        doc["results"]


def test_bench_json_with_per_iter_matches_nccl_tests(tmp_path):
    """-I 1 -K 1 through the CLI: each side's ``*_per_iter`` object right after it, as
    writePerIterReport writes it (with two ranks: per_process_max_times_us), and nccl-tests'
    tools/analyze_perf_json.py reads the file and finds times_us the max over the ranks."""
    js = tmp_path / "r.json"
    doc = _bench(tmp_path, "-I", "1", "-K", "1")
    ref = _fixture("all_reduce_perf_per_iter.json")
    assert shape_diff(doc, ref) == []
    _values_like_nccl_tests(doc)
    _validate(doc)
    assert doc["config"]["per_iter_timing"] == "true" and doc["config"]["per_iter_skip"] == 1
    for r in doc["results"]:
        for side in ("out_of_place_per_iter", "in_place_per_iter"):
            p = r[side]
            assert p["skipped_iterations"] == 1 and len(p["times_us"]) == 4
            assert len(p["per_process_max_times_us"]) == 2
            assert p["min_us"] == min(p["times_us"][1:])
    cp = subprocess.run([sys.executable, str(FIX / "analyze_perf_json.py"), str(js), "--all"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "Consistency (times_us == max over process rows, OOP): PASS" in cp.stdout
    assert "Process rows: 2" in cp.stdout and "Summary skip: 1 leading iterations" in cp.stdout
    table = [ln.split() for ln in cp.stdout.splitlines() if re.match(r" +(8|16|32) ", ln)]
    assert [t[0] for t in table[:3]] == ["8", "16", "32"], cp.stdout


def test_several_series_results_has_the_first_only(tmp_path):
    """Two backends in one run: ``results`` holds what nccl-tests would have written for the
    first (its rows, its average), ``ncclpy.results`` every series' rows, named."""
    js = tmp_path / "r.json"
    cp = run_module("bench", "all_reduce", "--backend", "ncclpy,torch", "--device", "cpu",
                    "--nproc", "2", "-b", "8", "-e", "32", "-f", "4", "-n", "2", "-w", "1",
                    "-c", "1", "-q", "-J", str(js), timeout=150)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    doc = json.loads(js.read_text())
    _validate(doc)
    assert shape_diff(doc, _fixture("all_reduce_perf.json")) == []
    ext = doc["ncclpy"]
    assert ext["series"] == ["ncclpy", "torch"]
    assert [(r["series"], r["backend"], r["size"]) for r in ext["results"]] == [
        ("ncclpy", "ncclpy", 8), ("ncclpy", "ncclpy", 32), ("torch", "torch", 8),
        ("torch", "torch", 32)]
    keys = list(doc["results"][0])
    assert [{k: r[k] for k in keys} for r in ext["results"] if r["series"] == "ncclpy"] == \
        doc["results"]
    assert doc["average_bus_bandwidth"]["bandwidth"] == \
        ext["average_bus_bandwidth_by_backend"]["ncclpy"]


# ------------------------------------------------------------------------ build_json directly
def _per_iter(base: float, ranks: int = 2) -> dict:
    """A side's per-iteration report in nccl-tests' keys, given out of order: build_json
    writes writePerIterReport's order."""
    times = [base + 3.0, base, base + 0.1, base + 0.2]
    rows = [times, [t - 0.05 for t in times]][:ranks]
    rep = {"times_us": times, "cv_pct": 0.7, "stdev_us": 0.08, "p99_us": base + 0.2,
           "p95_us": base + 0.2, "p50_us": base + 0.1, "avg_us": base + 0.1, "max_us": base + 0.2,
           "min_us": base, "skipped_iterations": 1}
    if ranks > 1:
        rep["per_process_max_times_us"] = rows
    return rep


def _doc(rows_by_backend: dict, per_iter: bool = False) -> dict:
    config = {"nthreads": 1, "ngpus": 1, "minimum_bytes": 8, "maximum_bytes": 32,
              "step_factor": 2, "warmup_iters": 1, "iterations": 4, "aggregated_iterations": 1,
              "validation": 1, "graph": 0, "blocking_collectives": "false",
              "per_iter_timing": "true" if per_iter else "false",
              "per_iter_skip": 1 if per_iter else 0, "parallel_init": "false"}
    return output.build_json(
        rows_by_backend=rows_by_backend, args=["python -m bench", "all_reduce"],
        nccl_version=23203, config=config,
        devices=[{"rank": 0, "group": 0, "pid": 1, "hostname": "h", "device": 0,
                  "device_hex": "0000:1b:00", "device_info": "NVIDIA H200"}],
        start_time=output.now(),
        extension={"bench_version": "0", "collective": "all_reduce", "program":
                   "all_reduce_perf", "world_size": 2, "device": "cuda", "average": "avg",
                   "timer": "events", "backends": [{"name": "ncclpy", "label": "ncclpy",
                                                    "nccl_version": 23203}],
                   "skipped": [], "unalign": 0})


def _rows(backend: str, per_iter: bool = False, wrong: Any = 0) -> List[Row]:
    out = []
    for size in (8, 16, 32):
        t = 10.0 + size / 8
        oop = Side(t, size / t / 1e3, size / t / 1e3, wrong, _per_iter(t) if per_iter else None)
        ip = Side(t + 0.25, size / t / 1e3, size / t / 1e3, wrong,
                  _per_iter(t + 0.25) if per_iter else None)
        out.append(Row(backend, size, size // 4, "float", "float32", "sum", -1, oop, ip, 4))
    return out


def test_build_json_with_per_iter_matches_nccl_tests():
    """Sides carrying -I's report: ``out_of_place_per_iter``/``in_place_per_iter`` right after
    their side, in writePerIterReport's key order, whatever order they came in."""
    doc = json.loads(json.dumps(_doc({"ncclpy": _rows("ncclpy", per_iter=True)}, True)))
    assert shape_diff(doc, _fixture("all_reduce_perf_per_iter.json")) == []
    _validate(doc)
    plain = json.loads(json.dumps(_doc({"ncclpy": _rows("ncclpy")})))
    assert shape_diff(plain, _fixture("all_reduce_perf.json")) == []
    one = _rows("ncclpy", per_iter=True)
    one[0].oop.per_iter = _per_iter(11.0, ranks=1)        # one process: no per-process rows
    got = _doc({"ncclpy": one}, True)["results"][0]
    assert "per_process_max_times_us" not in got["out_of_place_per_iter"]
    assert "per_process_max_times_us" in got["in_place_per_iter"]


def test_per_iter_keys_nccl_tests_does_not_write_are_refused():
    rows = _rows("ncclpy", per_iter=True)
    rows[0].ip.per_iter = dict(rows[0].ip.per_iter, median_us=1.0)
    with pytest.raises(ValueError, match="median_us"):
        _doc({"ncclpy": rows}, True)


def test_series_extras_live_under_ncclpy_only():
    """combination, bits, predicted_us, timestamp, cycle: on ``ncclpy.results`` records, never
    on ``results``; NaN is the string "nan" anywhere and the file stays strict JSON."""
    rows = _rows("ncclpy")
    for r in rows:
        r.combo = "ring/simple"
        r.extra.update(combination={"label": "ring/simple", "algorithm": "Ring",
                                    "protocol": "Simple", "env": {"NCCL_ALGO": "Ring"}},
                       predicted_us=None, timestamp=output.now(), cycle=0)
    rows[1].oop.busbw = float("nan")
    doc = _doc({"ncclpy ring/simple": rows, "torch": _rows("torch", wrong=None)})
    _validate(doc)
    assert [list(r) for r in doc["results"]] == [list(_fixture("all_reduce_perf.json")[
        "results"][0])] * 3
    rec = doc["ncclpy"]["results"][0]
    assert list(rec)[9:] == ["series", "backend", "combination", "predicted_us", "timestamp",
                             "cycle"]
    assert rec["series"] == "ncclpy ring/simple" and rec["backend"] == "ncclpy"
    assert doc["results"][1]["out_of_place"]["bus_bw"] == "nan"
    assert doc["ncclpy"]["results"][3]["out_of_place"]["nwrong"] is None
    assert doc["out_of_bounds"]["okay"] == "true"
    assert doc["average_bus_bandwidth"]["bandwidth"] == "nan"     # the NaN is in the first
    assert isinstance(doc["ncclpy"]["average_bus_bandwidth_by_backend"]["torch"], float)


def test_write_json_never_writes_a_bare_nan(tmp_path):
    doc = _doc({"ncclpy": _rows("ncclpy")})
    doc["ncclpy"]["ratios"] = [{"x": float("inf")}]
    path = output.write_json(str(tmp_path / "r.json"), doc)

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in the file")
    back = json.loads(Path(path).read_text(), parse_constant=refuse)
    assert back["ncclpy"]["ratios"] == [{"x": "inf"}]
