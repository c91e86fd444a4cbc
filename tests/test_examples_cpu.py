"""examples/ without a GPU: the inputs each example builds, pushed through
ncclpy.reference (and through the example's own layout steps), give the values the seed
tutorials show (ncclpy.check.seed_examples); every E-id has a script; scripts compile, import
without CuPy and answer --help; the output format round-trips."""
from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from seed_util import seeds_dir  # noqa: E402  (tests/ is on sys.path via conftest)
from ncclpy.semantics import reference as R
from ncclpy.semantics import registry
from ncclpy.buffers.buffer import as_buffer
from ncclpy.check import seed_examples as S
from ncclpy.errors import ArgumentError, UnsupportedError
from ncclpy.semantics.ops import parse_op
from ncclpy.plan.types import PlanContext

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import _common  # noqa: E402  (examples/_common.py)
from ncclpy.info import no_gpu_reason  # noqa: E402

SCRIPTS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
MODULES = {p.name: _common.load_example(str(p)) for p in SCRIPTS}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for v in ("NCCLPY_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        env.pop(v, None)
    return env


def _inputs_by_key() -> dict:
    """key -> (script name, builder) over every example's INPUTS."""
    out = {}
    for name, mod in MODULES.items():
        for key, fn in mod.INPUTS.items():
            assert key not in out, f"{key} built in both {out[key][0]} and {name}"
            out[key] = (name, fn)
    return out


INPUTS = _inputs_by_key()
DATA_KEYS = [e.key for e in S.EXAMPLES
             if e.collective != "barrier" and not e.extra.get("benchmark")]


def _as_table_form(value, like):
    """An example's input in the table's form: a list of per-peer arrays is stacked."""
    if value is None:
        return None
    if isinstance(value, list):
        return np.stack(value).reshape(np.shape(like))
    return value


def _example_inputs(entry):
    _, fn = INPUTS[entry.key]
    n = entry.world_size
    return [_as_table_form(fn(r, n), entry.make_input(r, n)) for r in range(n)]


def _assert_outputs(got, want, what):
    assert len(got) == len(want), what
    for r, (g, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        assert g is not None, f"{what}: rank {r} has no output, expected {w}"
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{what}: rank {r} shape {g.shape} != {w.shape}"
        assert np.array_equal(g, w), f"{what}: rank {r}\n{g}\n!=\n{w}"


# --------------------------------------------------------------------------- coverage

def test_there_are_twelve_scripts_and_a_readme():
    assert len(SCRIPTS) == 12, [p.name for p in SCRIPTS]
    readme = (EXAMPLES / "README.md").read_text()
    for p in SCRIPTS:
        assert f"({p.name})" in readme, f"README does not link {p.name}"
    assert "From torch.distributed to ncclpy" in readme


def test_every_seed_id_has_exactly_one_section_with_the_seed_world_size():
    where = {}
    for name, mod in MODULES.items():
        for s in mod.SECTIONS:
            assert s.eid not in where, f"{s.eid} in {where.get(s.eid)} and {name}"
            where[s.eid] = (name, s.world_size)
    for eid in S.ids():
        assert eid in where, f"no example script runs {eid}"
    for e in S.EXAMPLES:
        assert where[e.id][1] == e.world_size, (
            f"{e.id}: {where[e.id][0]} runs it with {where[e.id][1]} ranks, the seed with "
            f"{e.world_size}")


def test_root_readme_has_the_torch_to_ncclpy_table_linking_every_example():
    text = (ROOT / "README.md").read_text()
    assert "## From torch.distributed to ncclpy" in text
    section = text.split("## From torch.distributed to ncclpy", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\((examples/[^)#]+)", section)
    for link in links:
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"
    for p in SCRIPTS:
        assert f"examples/{p.name}" in links, f"the README table does not link {p.name}"
    for call in ("dist.all_reduce", "dist.isend", "dist.barrier", "dist.all_to_all_single"):
        assert call in section, call


def test_every_data_example_has_an_input_builder():
    for key in DATA_KEYS:
        assert key in INPUTS, f"no example defines inputs for {key}"


# The seeds' own README (tests/seed_util.py finds it); its table names E1-E35, some as
# ranges ("E18–E21").
ALL_IDS = [f"E{i}" for i in range(1, 36)]


def _seed_readme():
    return seeds_dir() / "README.md"


def _readme_ids(text: str) -> list:
    """Every E-number in the seed table's id column, ranges expanded."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\|\s*E(\d+)(?:\s*[–-]\s*E(\d+))?\s*\|", line)
        if m:
            lo = int(m.group(1))
            hi = int(m.group(2) or lo)
            out += [f"E{i}" for i in range(lo, hi + 1)]
    return out


def test_every_id_in_the_seed_readme_is_covered_by_an_example_with_expectations():
    ids = _readme_ids(_seed_readme().read_text(encoding="utf-8"))
    assert ids == ALL_IDS, f"the seed README lists {ids}"
    sections = {s.eid: name for name, mod in MODULES.items() for s in mod.SECTIONS}
    for eid in ids:
        assert eid in sections, f"{eid}: no example script has a section for it"
        entries = [e for e in S.EXAMPLES if e.id == eid]
        assert entries, f"{eid}: no expectation in ncclpy.check.seed_examples"
        for e in entries:
            want = e.expected_outputs()
            assert len(want) == e.world_size, e.key
            if not e.extra.get("benchmark"):       # E33 prints a measurement, checked by form
                assert any(w is not None for w in want), f"{e.key}: nothing expected"
                if e.collective != "barrier":
                    assert e.key in INPUTS, f"{e.key}: {sections[eid]} builds no input"


def _readme_id_table():
    """{id: (script, ranks)} from examples/README.md's "Seed example → script" table."""
    out = {}
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        m = re.match(r"^\| (E\d+) \| [^|]+ \| \[([0-9a-z_]+\.py)\]\(\2\) \| [^|]+ \| (\d+) \|$",
                     line)
        if m:
            assert m.group(1) not in out, f"{m.group(1)} twice in the README table"
            out[m.group(1)] = (m.group(2), int(m.group(3)))
    return out


def test_examples_readme_maps_every_id_to_the_script_that_runs_it():
    table = _readme_id_table()
    assert sorted(table, key=lambda k: int(k[1:])) == ALL_IDS
    for eid, (script, ranks) in table.items():
        assert script in MODULES, f"{eid}: README names {script}, which does not exist"
        secs = {s.eid: s for s in MODULES[script].SECTIONS}
        assert eid in secs, f"{eid}: README says {script}, which has no such section"
        assert secs[eid].world_size == ranks, (eid, ranks, secs[eid].world_size)


# --------------------------------------------------------------------------- inputs and values

@pytest.mark.parametrize("key", DATA_KEYS)
def test_example_inputs_equal_the_tutorials(key):
    entry = S.get(key)
    _, fn = INPUTS[key]
    for r in range(entry.world_size):
        want = entry.make_input(r, entry.world_size)
        got = fn(r, entry.world_size)
        if want is None:
            assert got is None, f"{key} rank {r}: the tutorial has no input here"
            continue
        got = _as_table_form(got, want)
        assert got.dtype == want.dtype, f"{key} rank {r}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{key} rank {r}: shape {got.shape} != {want.shape}"
        assert np.array_equal(got, want), f"{key} rank {r}:\n{got}\n!=\n{want}"


@pytest.mark.parametrize("key", DATA_KEYS)
def test_reference_on_example_inputs_gives_the_tutorials_values(key):
    entry = S.get(key)
    ins = _example_inputs(entry)
    _assert_outputs(entry.reference_outputs(ins), entry.expected_outputs(ins), key)


def test_barrier_example_sleeps_match_the_tutorial():
    e = S.get("E29")
    mod = MODULES["10_barrier.py"]
    arrivals = [mod.sleep_seconds(r, e.world_size) for r in range(e.world_size)]
    assert arrivals == e.inputs()
    assert R.barrier(arrivals=arrivals) == e.expected_outputs()


# ------------------------------------------------------------------ the examples' layout steps

def _gathered_blocks(inputs):
    """NCCL's raw gather/all_gather output: the blocks back to back (reference along axis 0)."""
    flat = [np.ascontiguousarray(a).reshape(-1) for a in inputs]
    out = R.all_gather(flat)[0]
    return out.reshape(len(inputs), *inputs[0].shape)


def test_e2_column_gather_layout():
    e = S.get("E2")
    mod = MODULES["01_gather.py"]
    ins = [mod.e2_input(r, e.world_size) for r in range(e.world_size)]
    shown = mod.e2_layout(_gathered_blocks(ins))
    _assert_outputs([shown] + [None] * 3, e.expected_outputs(), "E2")


def test_e4_column_all_gather_through_the_transpose():
    e = S.get("E4")
    mod = MODULES["02_all_gather.py"]
    ins = [np.ascontiguousarray(mod.e4_input(r, e.world_size).T) for r in range(e.world_size)]
    rows = np.concatenate(ins, axis=0)                       # all_gather of the (2,5) rows
    assert np.array_equal(rows, R.all_gather([a.reshape(-1) for a in ins])[0].reshape(-1, 5))
    _assert_outputs([mod.e4_layout(rows)] * 4, e.expected_outputs(), "E4")


def test_e10_column_reduce_scatter_through_the_transpose():
    e = S.get("E10")
    mod = MODULES["06_reduce_scatter.py"]
    ins = [np.ascontiguousarray(mod.e10_input(r, e.world_size).T) for r in range(e.world_size)]
    outs = R.reduce_scatter([a.reshape(-1) for a in ins], op="sum")
    _assert_outputs([o.reshape(5, 1) for o in outs], e.expected_outputs(), "E10")


def test_e12_column_all_to_all_with_contiguous_column_copies():
    e = S.get("E12")
    mod = MODULES["07_all_to_all.py"]
    n = e.world_size
    sends = []
    for r in range(n):
        local = mod.e12_input(r, n)
        cols = [np.ascontiguousarray(local[:, j:j + 1]) for j in range(n)]
        assert not local[:, 0:1].flags.c_contiguous          # why the example copies
        sends.append(np.concatenate([c.reshape(-1) for c in cols]))
    outs = R.all_to_all(sends)
    shown = [np.concatenate([b.reshape(5, 1) for b in np.split(o, n)], axis=1) for o in outs]
    _assert_outputs(shown, e.expected_outputs(), "E12")


def test_e32_chain_reduce_scatter_then_all_gather():
    e31, e32 = S.get("E31"), S.get("E32")
    mod = MODULES["06_reduce_scatter.py"]
    rs = R.reduce_scatter([mod.e31_input(r, 4) for r in range(4)], op="sum")
    _assert_outputs(rs, e32.inputs(), "E32 input = E31 output")
    _assert_outputs(R.all_gather(rs), e32.expected_outputs(), "E32")
    _assert_outputs(rs, e31.expected_outputs(), "E31")


def test_list_forms_print_the_tutorials_values():
    # E20/E21: a list of n (1,) buffers, printed concatenated; E25/E26: n (5,) buffers, nested
    for key, script, join in (("E20", "01_gather.py", np.concatenate),
                              ("E21", "02_all_gather.py", np.concatenate),
                              ("E25", "01_gather.py", np.stack),
                              ("E26", "02_all_gather.py", np.stack)):
        e = S.get(key)
        fn = MODULES[script].INPUTS[key]
        ins = [fn(r, e.world_size) for r in range(e.world_size)]
        want = e.expected_outputs()
        for r, w in enumerate(want):
            if w is not None:
                assert np.array_equal(join([np.asarray(a) for a in ins]), w), key


def test_uneven_all_to_all():
    mod = MODULES["07_all_to_all.py"]
    n = 4
    ins = [mod.uneven_input(r, n) for r in range(n)]
    table = [mod.uneven_send_counts(s, n) for s in range(n)]
    outs = R.all_to_all(ins, send_counts=table)
    for r in range(n):
        assert [table[s][r] for s in range(n)] == mod.uneven_recv_counts(r, n)
        want = np.concatenate([np.full(r + 1, 10 * s + r, np.float32) for s in range(n)])
        assert np.array_equal(outs[r], want), (r, outs[r])
        assert len(ins[r]) == sum(table[r])


def test_reduce_ops_lesson_values():
    mod = MODULES["12_reduce_ops.py"]
    ins = [mod.ops_input(r, 4) for r in range(4)]
    assert set(mod.EXPECTED) == {f"OPS.{k}" for k in mod.OPS}
    for name, op in mod.OPS.items():
        outs = R.all_reduce(ins, op=op)
        for r in range(4):
            assert np.array_equal(outs[r], np.array(mod.EXPECTED[f"OPS.{name}"], np.float32)), \
                (name, outs[r])
    for name in mod.BITWISE:
        with pytest.raises(UnsupportedError, match="bitwise"):
            parse_op(name)


def test_bandwidth_figures():
    mod = MODULES["11_bandwidth.py"]
    nbytes, secs, n = 64 << 20, 1.25e-3, 4
    seed = mod.seed003_bandwidth(nbytes, secs, n)
    assert seed * 1024 ** 3 == pytest.approx(S.busbw_003(nbytes, secs, n))
    algbw, busbw = mod.bus_bandwidth(nbytes, secs, n)
    assert algbw == pytest.approx(nbytes / secs / 1e9)
    assert busbw == pytest.approx(algbw * 2 * (n - 1) / n)
    # same algebra, different units: GiB/s vs GB/s
    assert seed * 1024 ** 3 / 1e9 == pytest.approx(busbw)
    assert registry.get("all_reduce").busbw_factor(n) == pytest.approx(1.5)


# --------------------------------------------------------------------- strided column views

class _DeviceLayout:
    """What a CuPy array of ``a``'s shape, dtype and strides presents to ncclpy: its
    ``__cuda_array_interface__`` (strides None when C-contiguous, as CuPy does).  Only the layout
    is read here; no memory behind the pointer is touched and no NCCL call is planned from it
    unless the layout is accepted."""

    def __init__(self, a: np.ndarray) -> None:
        self.device = 0
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": a.dtype.str, "version": 3,
            "data": (a.__array_interface__["data"][0], False),
            "strides": None if a.flags.c_contiguous else a.strides}


def _parse_list(views, name):
    return [as_buffer(_DeviceLayout(v), f"{name}[{i}]") for i, v in enumerate(views)]


# (id, script, the array the example takes column views of, width, which argument gets them)
COLUMN_CASES = [
    ("E2", "01_gather.py", lambda n: np.empty((5, 2 * n), np.float32), 2, "recvbuf"),
    ("E4", "02_all_gather.py", lambda n: np.empty((5, 2 * n), np.float32), 2, "recvbuf"),
    ("E10", "06_reduce_scatter.py",
     lambda n: MODULES["06_reduce_scatter.py"].e10_input(0, n), 1, "sendbuf"),
    ("E12", "07_all_to_all.py", lambda n: MODULES["07_all_to_all.py"].e12_input(0, n), 1,
     "sendbuf"),
]


@pytest.mark.parametrize("eid,script,make,width,arg", COLUMN_CASES,
                         ids=[c[0] for c in COLUMN_CASES])
def test_column_variants_refuse_strided_views_with_a_clear_error(eid, script, make, width, arg):
    """The "wrong on purpose" call of each column example: the views _common.column_views gives
    (torch.split(x, k, dim=1)) are refused before any NCCL call, with a message that says what
    is wrong and what to do; their contiguous copies are accepted."""
    src = (EXAMPLES / script).read_text()
    assert "column_views(" in src and f'emit_error("{eid}"' in src, f"{script} lost its {eid} demo"
    n = S.get(eid).world_size
    views = _common.column_views(make(n), width)
    assert len(views) == n and all(v.shape == (5, width) for v in views)
    with pytest.raises(ArgumentError) as exc:
        _parse_list(views, arg)
    msg = str(exc.value)
    assert msg.startswith(f"{arg}[0]: not C-contiguous"), msg
    assert "contiguous copy" in msg and "ascontiguousarray" in msg, msg
    copies = _parse_list([np.ascontiguousarray(v) for v in views], arg)
    assert all(c.contiguous and c.count == 5 * width for c in copies)


def test_column_layout_steps_plan_to_one_native_call():
    """The "right" column forms (E4 and E10: the transposes as contiguous rows) are planned into
    one NCCL call each, on the ranks' real buffers' layouts."""
    n = 4
    x = MODULES["02_all_gather.py"].e4_input(1, n)
    xt = np.ascontiguousarray(x.T)                                    # (2, 5)
    rows = np.empty((2 * n, 5), np.float32)
    plan = registry.get("all_gather").plan(PlanContext(1, n), as_buffer(_DeviceLayout(xt)),
                                           as_buffer(_DeviceLayout(rows)))
    assert [c.fn for c in plan.steps] == ["AllGather"] and plan.steps[0].args[2] == 10
    data = MODULES["06_reduce_scatter.py"].e10_input(2, n)
    t = np.ascontiguousarray(data.T)                                  # (n, 5)
    col = np.empty(5, np.float32)
    plan = registry.get("reduce_scatter").plan(PlanContext(2, n), as_buffer(_DeviceLayout(t)),
                                               as_buffer(_DeviceLayout(col)), op="sum")
    assert [c.fn for c in plan.steps] == ["ReduceScatter"] and plan.steps[0].args[2] == 5


# --------------------------------------------------------------------------- the output format

def test_emit_and_parse_round_trip(capsys):
    _common.emit("E3", 2, np.arange(6, dtype=np.float32).reshape(2, 3))
    _common.emit("E1", 1, None)
    _common.emit("E6-2x5", 0, [np.ones(2, np.float32), np.zeros(2, np.float32)])
    _common.emit_input("E11.uneven", 3, np.array([1, 2], np.int64))
    _common.emit_error("E10", 0, ValueError("sendbuf[0]: not contiguous\nsecond line"))
    _common.emit("E33", 1, {"busbw_GBps": 1.5, "bytes": 8})
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "E3 rank=2 result=[[0.0,1.0,2.0],[3.0,4.0,5.0]]"
    assert lines[1] == "E1 rank=1 result=null"
    text = "\n".join("[rank 0] " + ln if i % 2 else ln for i, ln in enumerate(lines))
    text += "\n# a comment\nsomething else rank=1\n"
    recs = _common.parse(text)
    assert [(lbl, r, k) for lbl, r, k, _ in recs] == [
        ("E3", 2, "result"), ("E1", 1, "result"), ("E6-2x5", 0, "result"),
        ("E11.uneven", 3, "input"), ("E10", 0, "error"), ("E33", 1, "result")]
    res = _common.collect(text)
    assert res[("E3", 2)] == [[0, 1, 2], [3, 4, 5]]
    assert res[("E1", 1)] is None
    assert res[("E6-2x5", 0)] == [[1, 1], [0, 0]]
    assert res[("E33", 1)] == {"busbw_GBps": 1.5, "bytes": 8}
    assert _common.collect(text, "error")[("E10", 0)] == \
        "ValueError: sendbuf[0]: not contiguous second line"
    assert _common.collect(text, "input")[("E11.uneven", 3)] == [1, 2]
    with pytest.raises(ValueError, match="twice"):
        _common.collect(text + "\nE1 rank=1 result=[1]\n")


def test_launcher_detection_and_selection():
    assert not _common.launched_by_launcher({})
    assert _common.launched_by_launcher({"NCCLPY_RANK": "0"})
    assert _common.launched_by_launcher({"RANK": "3"})          # torchrun
    assert _common.launched_by_launcher({"OMPI_COMM_WORLD_RANK": "1"})
    secs = MODULES["02_all_gather.py"].SECTIONS
    assert [s.eid for s in _common._select(secs, ["e26", "E3"])] == ["E3", "E26"]
    with pytest.raises(SystemExit, match="E99"):
        _common._select(secs, ["E99"])


# --------------------------------------------------------------------------- the scripts

@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_scripts_import_neither_cupy_nor_torch():
    code = ("import sys, glob; sys.path.insert(0, 'examples'); import _common\n"
            "for p in sorted(glob.glob('examples/[0-9][0-9]_*.py')): _common.load_example(p)\n"
            "bad = [m for m in ('cupy', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), check=True, timeout=60)


#: without a usable GPU a script stops before starting any rank, with one line; on a machine with
#: one, tests/gpu/test_examples_gpu.py runs every example to the end both ways instead
_GPU_LESS = pytest.mark.skipif(
    not no_gpu_reason(),
    reason="a GPU is usable here: tests/gpu/test_examples_gpu.py runs the examples to the end")


def _one_line_no_gpu(script: Path, stderr: str, hint: str) -> str:
    """The no-GPU line a script prints: exactly one, naming the script, the reason and the
    command that runs it on the CPU backend (``hint``)."""
    lines = [ln for ln in stderr.splitlines() if "needs an NVIDIA GPU" in ln]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    line = lines[0]
    assert line.endswith(f"python {os.path.relpath(script, ROOT)}: needs an NVIDIA GPU with a "
                         f"working CUDA driver, CuPy and NCCL; here: {no_gpu_reason()}; without "
                         f"a GPU: {hint}"), line
    return line


@_GPU_LESS
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_started_plainly_without_a_gpu_a_script_says_so_in_one_line(script):
    """``python examples/x.py`` on a machine without a GPU: one line saying a GPU is needed and
    why (the reason ``ncclpy info`` gives), exit status 1, no rank spawned, no traceback."""
    res = subprocess.run([sys.executable, os.path.relpath(script, ROOT)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == _common.EXIT_NO_GPU == 1, res.stdout + res.stderr
    assert res.stdout == "", res.stdout                 # no "# ncclpy.spawn: ..." line
    assert res.stderr.count("\n") == 1
    _one_line_no_gpu(script, res.stderr, f"python {os.path.relpath(script, ROOT)} --cpu")


@_GPU_LESS
def test_under_a_launcher_without_a_gpu_only_local_rank_0_says_so():
    """``ncclpy run -n 2 python examples/09_send_recv.py``: one line from rank 0 (none from rank
    1), then the launcher's own line; no traceback."""
    script = EXAMPLES / "09_send_recv.py"
    res = subprocess.run([sys.executable, "-m", "ncclpy", "run", "-n", "2", sys.executable,
                          os.path.relpath(script, ROOT)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "ncclpy.spawn" not in out
    line = _one_line_no_gpu(script, out,
                            f"ncclpy run --cpu -n 2 python {os.path.relpath(script, ROOT)}")
    assert line.startswith("[rank 0] ")


@_GPU_LESS
def test_without_a_gpu_a_silent_rank_never_ends_the_job_before_rank_0_said_why(tmp_path):
    """Rank 0 slow to find out (here: 3 s of extra start-up) must still get its line out: the
    launcher stops every rank at the first failure, so a silent rank 1 exiting first used to get
    rank 0 stopped before it printed (seen in CI).  The job's first failure is rank 0's."""
    script = tmp_path / "slow_rank0.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "import _common\n"
        "if os.environ.get('NCCLPY_LOCAL_RANK') == '0':\n"
        "    time.sleep(3)\n"
        "_common.require_gpu('slow')\n")
    res = subprocess.run([sys.executable, "-m", "ncclpy", "run", "-n", "2", sys.executable,
                          str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert [ln for ln in out.splitlines() if "needs an NVIDIA GPU" in ln] == [
        f"[rank 0] slow: needs an NVIDIA GPU with a working CUDA driver, CuPy and NCCL; here: "
        f"{no_gpu_reason()}"], out
    assert "rank 0 exited with code 1" in out and "rank 1 exited" not in out, out
    assert "Traceback" not in out, out


def test_a_silent_rank_waits_then_exits_quietly_when_no_launcher_stops_it(monkeypatch, capsys):
    """Without a launcher to stop it (srun without --kill-on-bad-exit), a rank other than local
    rank 0 still ends: after ``quiet_wait`` seconds, status 1, nothing printed."""
    monkeypatch.setattr("ncclpy.info.no_gpu_reason", lambda: "no CUDA driver")
    slept = []
    monkeypatch.setattr(_common.time, "sleep", slept.append)
    env = {"NCCLPY_RANK": "1", "NCCLPY_LOCAL_RANK": "1"}
    with pytest.raises(SystemExit) as exc:
        _common.require_gpu("p", env, quiet_wait=0.5)
    assert exc.value.code == _common.EXIT_NO_GPU and slept == [0.5]
    assert capsys.readouterr().err == ""
    slept.clear()
    with pytest.raises(SystemExit):                      # local rank 0 prints and does not wait
        _common.require_gpu("p", {"NCCLPY_RANK": "1", "NCCLPY_LOCAL_RANK": "0"})
    assert slept == [] and "p: needs an NVIDIA GPU" in capsys.readouterr().err


def test_help_lists_each_scripts_examples():
    for p in SCRIPTS:
        res = subprocess.run([sys.executable, str(p), "--help"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        for s in MODULES[p.name].SECTIONS:
            assert f"{s.eid} " in res.stdout and f"{s.world_size} ranks" in res.stdout, \
                (p.name, s.eid, res.stdout)
