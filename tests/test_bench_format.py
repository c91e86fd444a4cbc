"""``python -m bench``'s output: nccl-tests' number formatting, the table's rows, header and
footer, the ratios between backends, and the JSON document (schema, nccl-tests' layout, no
secrets, never overwritten).  Pure functions, in process (split from tests/test_bench.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import output
from bench.output import Row, Side

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "bench" / "schema.json").read_text())


def _validate(doc):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, SCHEMA)


# ---------------------------------------------------------------------------- formatting
def test_float_str_is_nccl_tests_getFloatStr():
    assert output.float_str(9.62, 7) == "   9.62"
    assert output.float_str(123.456, 7) == " 123.46"
    assert output.float_str(12345.6, 7) == "12345.6"
    assert output.float_str(1234567.0, 7) == "1234567"
    assert output.float_str(123456789.0, 7) == "1.2e+08"
    assert output.float_str(0.0, 6) == "  0.00"
    assert output.float_str(1234.5, 6) == "1234.5"
    assert output.float_str(99999.0, 6) == " 99999"


def _row(backend="torch", size=1024, wrong=0, busbw=1.5):
    return Row(backend, size, size // 4, "float", "float32", "sum", -1,
               Side(12.34, 0.08, busbw, wrong), Side(11.0, 0.09, busbw * 1.1, None), iters=20)


def test_row_and_header_format():
    line = output.format_row(_row())
    #                  size         count      type   redop    root
    assert line == ("        1024           256     float     sum      -1"
                    "    12.34    0.08    1.50       0    11.00    0.09    1.65    N/A")
    head = output.table_header()
    assert head[2].split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw",
                               "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"]
    assert output.format_row(_row(), multi=True).endswith("  torch")


def test_footer_counts_errors_and_averages_busbw():
    lines, ok = output.footer_lines({"torch": [_row(wrong=0), _row(wrong=3)]}, "x_perf")
    assert not ok
    assert lines[0] == "# Out of bounds values : 1 FAILED"
    assert lines[1] == "# Avg bus bandwidth    : %g" % ((1.5 + 1.65 + 1.5 + 1.65) / 4)
    lines, ok = output.footer_lines({"torch": [_row()]}, "x_perf", min_bw=100.0)
    assert not ok and lines[1].endswith("FAILED")


def test_ratios_between_backends():
    rows = {"ncclpy": [_row("ncclpy", busbw=2.0)], "torch": [_row("torch", busbw=1.0)]}
    ratios = output.ratio_rows(rows)
    assert len(ratios) == 1 and ratios[0]["out_of_place_busbw"] == pytest.approx(2.0)
    assert ratios[0]["numerator"] == "ncclpy" and ratios[0]["denominator"] == "torch"
    text = "\n".join(output.ratio_lines(ratios))
    assert "Ratios ncclpy / torch" in text and "2.000" in text


def test_json_document_matches_schema_and_nccl_tests_layout():
    rows = {"ncclpy": [_row("ncclpy")], "torch": [_row("torch", wrong=None)]}
    doc = output.build_json(
        rows_by_backend=rows, args=["python -m bench", "all_reduce"], nccl_version=23203,
        config={"nthreads": 1, "ngpus": 1, "minimum_bytes": 8, "maximum_bytes": 1024,
                "step_factor": 2, "warmup_iters": 1, "iterations": 20,
                "aggregated_iterations": 1, "validation": 1, "graph": 0,
                "blocking_collectives": "false", "per_iter_timing": "false",
                "per_iter_skip": 0, "parallel_init": "false"},
        devices=[{"rank": 0, "group": 0, "pid": 1, "hostname": "h", "device": 0,
                  "device_hex": "0000:01:00", "device_info": "GPU"}],
        start_time=output.now(),
        extension={"bench_version": "0", "collective": "all_reduce", "program":
                   "all_reduce_perf", "world_size": 2, "device": "cuda", "average": "avg",
                   "timer": "host", "backends": [{"name": "ncclpy", "label": "ncclpy",
                                                  "nccl_version": 23203}],
                   "skipped": []})
    _validate(doc)
    assert list(doc)[:11] == ["version", "start_time", "args", "env", "nccl_version", "config",
                              "results", "out_of_bounds", "average_bus_bandwidth", "errors",
                              "end_time"]
    r, = doc["results"]                                  # the first series' rows only
    assert r["root"] == "    -1" and r["experiment_name"] == ""
    assert r["out_of_place"] == {"time": 12.34, "alg_bw": 0.08, "bus_bw": 1.5, "nwrong": 0.0}
    mine = doc["ncclpy"]["results"]                      # every series', named
    assert [(x["series"], x["backend"]) for x in mine] == [("ncclpy", "ncclpy"), ("torch", "torch")]
    assert mine[1]["out_of_place"]["nwrong"] is None
    assert doc["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert doc["average_bus_bandwidth"]["okay"] == "unchecked"
    bad = json.loads(json.dumps(doc))
    bad["results"][0]["root"] = 0
    with pytest.raises(Exception):
        _validate(bad)


def test_json_env_never_carries_secrets():
    env = output.safe_env({"NCCLPY_STORE_TOKEN": "s3cret", "NCCL_DEBUG": "INFO",
                           "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "x"})
    assert env == ["NCCLPY_STORE_TOKEN=<redacted>", "NCCL_DEBUG=INFO"]


def test_write_json_never_overwrites(tmp_path):
    p = tmp_path / "r.json"
    assert output.write_json(str(p), {"a": 1}) == str(p)
    assert output.write_json(str(p), {"a": 2}) == f"{p}.0"
    assert json.loads(p.read_text()) == {"a": 1}
