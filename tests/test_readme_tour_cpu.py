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


def test_the_tour_runs_on_the_cpu_backend_as_the_readme_says(tmp_path):
    code = _tour()
    assert "import cupy as cp" in code and "ncclpy.spawn(main, nprocs=4)" in code
    readme = (ROOT / "README.md").read_text()
    assert 'ncclpy.spawn(main, nprocs=4, device="cpu")' in readme      # what it tells users
    cpu = code.replace("import cupy as cp", "import numpy as np").replace("cp.", "np.")
    cpu = cpu.replace("ncclpy.spawn(main, nprocs=4)", 'ncclpy.spawn(main, nprocs=4, device="cpu")')
    # one write per line: the spawned ranks share the stdout pipe, and print()'s separate writes
    # of each word interleave across ranks when stdout is unbuffered (PYTHONUNBUFFERED=1, as CI)
    cpu = cpu.replace("    comm.close()", "    comm.close()\n    import os\n"
                      "    os.write(1, f'rank {rank} y {y.tolist()}\\n'.encode())")
    script = tmp_path / "tour.py"
    script.write_text(cpu)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLPY_", "RANK", "WORLD"))}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
    assert got == [f"rank {k} y {[6.0] * 5}" for k in range(4)], got
