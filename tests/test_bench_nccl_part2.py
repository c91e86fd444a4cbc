"""The bench's flags and output for NCCL 2.27-2.32's host API, part 2 (window registration
``-R``, the memory report ``-M``, ``--cta-policy``): parsed, refused precisely, version-gated
against the real libnccl where one answers, and written as bench/schema.json says (split from
tests/test_nccl_part2.py)."""
from __future__ import annotations

import pytest

from ncclpy import errors


def test_bench_parses_and_refuses_registration_memory_and_cta_policy(monkeypatch):
    import bench.cli as cli
    from ncclpy._nccl import lib as L
    monkeypatch.setattr(cli, "_no_gpu_reason", lambda: "")     # parse as on a GPU machine
    cfg = cli.parse_args(["all_reduce", "--device", "cuda", "-R", "1", "--cta-policy", "zero"])
    assert (cfg.register, cfg.memory_report, cfg.cta_policy) == (1, False, "zero")
    bad = [(["all_reduce", "--device", "cuda", "-R", "3"], "-R: expected 0 .none., 1"),
           (["all_reduce", "--device", "cuda", "--local_register", "-1"],
            "--local_register: expected 0"),
           (["all_reduce", "--device", "cuda", "-M", "2"], "-M: expected 0 or 1"),
           (["all_reduce", "--device", "cuda", "--backend", "ncclpy,cupy", "-R", "1"],
            "-R: needs --backend ncclpy only .* cupy cannot"),
           (["all_reduce", "--device", "cuda", "--cta-policy", "fastest"],
            "--cta-policy: .*fastest"),
           (["gather", "--device", "cuda", "-R", "2"],
            "-R 2: gather has buffers only on the root")]
    for argv, words in bad:
        with pytest.raises(errors.ArgumentError, match=words):
            cli.parse_args(argv)
    try:
        version = L.get_lib().version
    except errors.NcclpyError:
        pytest.skip("no libnccl here to gate -R 2 / -M on")
    if version >= 22907:          # the real libnccl is new enough: both parse
        cfg = cli.parse_args(["all_reduce", "--device", "cuda", "-R", "2", "-M", "1"])
        assert cfg.register == 2 and cfg.memory_report
    monkeypatch.setattr(L.get_lib(), "version", 22608)
    with pytest.raises(errors.ArgumentError, match=r"-R: ncclCommWindowRegister needs NCCL >= "
                                                   r"2\.27\.3"):
        cli.parse_args(["all_reduce", "--device", "cuda", "-R", "2"])
    with pytest.raises(errors.ArgumentError, match=r"-M: ncclCommMemStats needs NCCL >= 2\.29"):
        cli.parse_args(["all_reduce", "--device", "cuda", "-M", "1"])


def test_bench_memory_report_lines_and_schema():
    import json
    import os
    import jsonschema
    from bench import output
    lines = output.memory_lines({"ncclpy": {"suspendable_bytes": 5, "suspended": 0,
                                            "persistent_bytes": 7, "total_bytes": 12},
                                 "cupy": None})
    assert lines == ["# ncclpy: NCCL memory of rank 0's communicator (ncclCommMemStats): "
                     "total 12 B, persistent 7 B, suspendable 5 B",
                     "# cupy: NCCL memory: not reported by this backend"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    schema = json.load(open(os.path.join(root, "bench", "schema.json")))
    sub = schema["properties"]["ncclpy"]["properties"]
    jsonschema.validate({"ncclpy": {"suspendable_bytes": 5, "suspended": 0,
                                    "persistent_bytes": 7, "total_bytes": 12}, "x": None},
                        sub["memory"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"ncclpy": {"total_bytes": -1}}, sub["memory"])
    assert sub["registration"]["enum"] == [0, 1, 2]
    jsonschema.validate([3, 4], sub["registered"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([3], sub["registered"])
