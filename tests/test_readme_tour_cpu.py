"""The README's tour runs without a GPU, as the README says: its program with numpy in place of
CuPy and ``ncclpy.spawn(main, nprocs=4, device="cpu")`` (the CPU backend), 4 real processes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tour() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## A short tour.*?```python\n(.*?)```", text, re.S)
    assert m, "README.md has no tour program"
    return m.group(1)


def _cpu_tour() -> str:
    """The tour as the README tells a user without a GPU to write it (numpy, device="cpu"),
    each rank printing its result at the end in one write: the ranks share the stdout pipe, and
    print()'s separate writes of each word interleave across ranks when stdout is unbuffered
    (PYTHONUNBUFFERED=1, as in CI)."""
    code = _tour()
    assert "import cupy as cp" in code and "ncclpy.spawn(main, nprocs=4)" in code
    readme = (ROOT / "README.md").read_text()
    assert 'ncclpy.spawn(main, nprocs=4, device="cpu")' in readme      # what it tells users
    cpu = code.replace("import cupy as cp", "import numpy as np").replace("cp.", "np.")
    cpu = cpu.replace("ncclpy.spawn(main, nprocs=4)", 'ncclpy.spawn(main, nprocs=4, device="cpu")')
    return cpu.replace("    comm.close()", "    comm.close()\n    import os\n    os.write(1, "
                       "f'rank {rank} y {y.tolist()}\\n'.encode())")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLPY_", "RANK", "WORLD"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_the_tour_runs_on_the_cpu_backend_as_the_readme_says(tmp_path):
    script = tmp_path / "tour.py"
    script.write_text(_cpu_tour())
    r = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
    assert got == [f"rank {k} y {[6.0] * 5}" for k in range(4)], got


def test_the_tour_in_its_launcher_form_runs_under_ncclpy_run_cpu(tmp_path):
    """The README's other form: ``main(int(os.environ["RANK"]))`` in place of the spawn line,
    started by ``ncclpy run --cpu -n 4`` (4 processes in all, one job)."""
    readme = (ROOT / "README.md").read_text()
    assert 'main(int(os.environ["RANK"]))' in readme and "ncclpy run --cpu -n 4 python this.py" \
        in readme
    cpu = _cpu_tour().replace('    ncclpy.spawn(main, nprocs=4, device="cpu")',
                              '    import os\n    main(int(os.environ["RANK"]))')
    assert "spawn(" not in cpu
    script = tmp_path / "tour.py"
    script.write_text(cpu)
    r = subprocess.run([sys.executable, "-m", "ncclpy", "run", "--cpu", "-n", "4", sys.executable,
                        str(script)], env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = sorted(line.split("] ", 1)[-1] for line in r.stdout.splitlines() if "rank " in line)
    assert got == [f"rank {k} y {[6.0] * 5}" for k in range(4)], r.stdout
