"""The bits column's verdicts on a stand-in backend (one rank, no processes) whose output can be
made wrong on purpose: ``exact`` only when every bit is the model's, ``MISMATCH k/n`` counting
the differing elements, the first combination's output as the others' reference, runs that
vary counted; then the table's layout with the column and the plot's one line per
combination."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ncclpy.semantics import registry

from bench import bits as bitcol
from bench.backends import Backend, host_dtype
from bench.combos import Combo
from bench.config import SweepConfig
from bench.output import Row, Side, format_row, table_header
from bench.sweep import Coord

pytestmark = pytest.mark.timeout(60)


class _Copy(Backend):
    """One rank's all_reduce: the output is the input (what NCCL gives for one rank), its
    elements ``wrong`` flipped in the lowest bit, and ``drift`` more on every later run."""

    name = "ncclpy"

    def __init__(self, combo, wrong=(), drift=()):
        super().__init__()
        self.combo, self.nccl_env = combo, combo.env()
        self.wrong, self.drift, self.runs = list(wrong), list(drift), 0

    def bits_version(self):
        return 22809

    def empty(self, n, dtype):
        return np.zeros(n, host_dtype(dtype))

    def zero(self, arr):
        arr[...] = 0

    def upload(self, arr, host):
        arr[...] = host

    def download(self, arr):
        return arr.copy()

    def run(self, collective, bufs, op, root, in_place):
        out = bufs.send.copy()
        u = out.view(np.uint32)
        u[self.wrong] ^= 1
        if self.runs:
            u[self.drift] ^= 2
        self.runs += 1
        bufs.recv[...] = out


def _column(slots, repeat=0):
    cfg = SweepConfig(collectives=["all_reduce"], sizes=[4096], device="cpu",
                      combos=[s.combo for s in slots], repeat_bits=repeat)
    state = SimpleNamespace(cfg=cfg, coll=registry.get("all_reduce"), rank=0, world=1,
                            coord=Coord(None, 0, 1, 5.0))
    first = {slots[0].name: slots[0].combo.label} if len(slots) > 1 else {}
    return bitcol.BitsColumn(state, first)


def _row(col, b, seed=7):
    bufs = b.alloc("all_reduce", 1024, "float32")
    return col.row(b, bufs, "float32", "sum", -1, seed)


def test_exact_only_when_every_bit_is_the_models():
    ring = _Copy(Combo("Ring", "Simple"))
    doc = _row(_column([ring]), ring)
    assert doc["model"]["verdict"] == "exact" and doc["text"] == "exact"
    assert doc["model"]["differing"] == 0 and doc["model"]["compared"] == 1024
    assert doc["model"]["config"].startswith("all_reduce ring/simple, 1 ranks, 1024 float32")


def test_a_wrong_bit_is_a_mismatch_counted_and_shown():
    bad = _Copy(Combo("Ring", "LL"), wrong=[3, 500, 1023])
    doc = _row(_column([bad]), bad)
    assert doc["text"] == "MISMATCH 3/1024"
    assert doc["model"]["first_difference"].startswith("rank 0 element 3: predicted 0x")


def test_the_first_combination_is_the_others_reference():
    ring, tree, odd = (_Copy(Combo("Ring", "Simple")), _Copy(Combo("Tree", "Simple")),
                       _Copy(Combo("Tree", "LL"), wrong=[0, 1]))
    col = _column([ring, tree, odd])
    assert _row(col, ring)["text"] == "exact | first combination"
    assert _row(col, tree)["text"] == "exact | same bits"
    doc = _row(col, odd)
    assert doc["text"] == "MISMATCH 2/1024 | 2 of 1024 elements differ"
    assert doc["first"] == {"reference": "ring/simple", "is_reference": False, "differing": 2,
                            "compared": 1024}
    bufs = tree.alloc("all_reduce", 512, "float32")       # a size the reference did not run
    assert col.row(tree, bufs, "float32", "sum", -1, 9)["text"] == (
        "exact | ring/simple did not run this case")


def test_repeated_runs_that_vary_are_counted():
    steady, drifting = _Copy(Combo("Ring", "LL")), _Copy(Combo("Ring", "LL"), drift=[5, 6])
    assert _row(_column([steady], repeat=3), steady)["text"] == "exact | 3 runs: same bits"
    doc = _row(_column([drifting], repeat=3), drifting)
    assert doc["repeats"] == {"runs": 3, "differing": 2, "compared": 1024}
    assert doc["text"] == "exact | 3 runs: 2 of 1024 elements varied"
    assert drifting.runs == 3


def test_the_footer_fails_a_mismatch_or_varied_runs():
    def row(verdict, varied=0):
        r = Row("ncclpy", 8, 2, "float", "float32", "sum", -1, Side(1, 1, 1, 0),
                Side(1, 1, 1, 0), 1)
        r.extra["bits"] = {"model": {"verdict": verdict}, "text": "",
                           "repeats": {"runs": 2, "differing": varied, "compared": 2}}
        return r
    assert bitcol.summary_lines([row("exact"), row("n/a")]) == ([
        "# Bits vs the model    : 1 exact, 0 MISMATCH, 1 n/a",
        "# Bits across runs     : the same in all 2 rows (2 runs each)"], True)
    lines, ok = bitcol.summary_lines([row("exact"), row("MISMATCH")])
    assert not ok and lines[0].endswith("1 MISMATCH, 0 n/a FAILED")
    lines, ok = bitcol.summary_lines([row("exact", varied=1)])
    assert not ok and lines[1] == "# Bits across runs     : 1 of 1 rows varied FAILED"
    assert bitcol.summary_lines([]) == ([], True)


def test_the_table_puts_the_combination_and_the_bits_last():
    head = table_header(multi=True, bits=True, width=19, series="backend combination")
    assert head[2].endswith("#wrong  backend combination  bits (out of place)")
    r = Row("ncclpy", 1024, 256, "float", "float32", "sum", -1, Side(10.0, 0.1, 0.2, 0),
            Side(11.0, 0.1, 0.2, 0), 5, combo="tree/ll128")
    r.extra["bits"] = {"text": "exact | same bits"}
    line = format_row(r, multi=True, width=19)
    assert line.endswith("       0  ncclpy tree/ll128    exact | same bits")
    assert head[2].index("backend combination") == line.index("ncclpy tree/ll128")
    plain = Row("torch", 8, 2, "float", "float32", "sum", -1, Side(1, 1, 1, 0),
                Side(1, 1, 1, 0), 1)
    assert format_row(plain, multi=True).endswith("  torch")        # as before: no padding
    assert table_header(multi=True)[2].endswith("#wrong   backend")


def test_the_plot_draws_one_line_per_combination():
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from bench.plot import plot_figure
    labels = ["ring/ll", "ring/ll128", "ring/simple", "tree/ll", "tree/ll128", "tree/simple"]
    rows = {}
    for k, lab in enumerate(labels):
        rows[f"ncclpy {lab}"] = [
            Row("ncclpy", s, s // 4, "float", "float32", "sum", -1,
                Side(10.0, s / 1e4 * (k + 1), s / 1e4 * (k + 1), 0),
                Side(11.0, s / 1e4, s / 1e4, 0), 5, combo=lab) for s in (8, 1024, 1 << 20)]
    fig = plot_figure(rows, title="all_reduce_perf on 4 ranks (cpu)")
    ax = fig.axes[0]
    gids = [ln.get_gid() for ln in ax.lines]
    assert gids == [f"ncclpy {lab}/{p}" for lab in labels for p in ("oop", "ip")]
    colours = {ln.get_gid().rsplit("/", 1)[0]: to_hex(ln.get_color()) for ln in ax.lines}
    assert len(set(colours.values())) == len(labels)          # a colour per combination
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:len(labels)] == [f"ncclpy {lab}" for lab in labels]
