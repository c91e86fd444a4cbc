"""nccl-tests 2.19.6 beside ncclpy's bench: the carried sources and their build.

Two steps, one per machine:

* ``python -m bench.nccl_tests_build prepare [--dest wheels/nccl-tests]`` (a machine with
  network): nccl-tests' source at tag v2.19.6 (``git archive`` of a clone, ``--repo``; or a
  tarball given with ``--tarball``, such as GitHub's
  https://github.com/NVIDIA/nccl-tests/archive/refs/tags/v2.19.6.tar.gz) and MPICH's wheel from
  the package index (``pip download mpich==5.0.2``: MPI's headers, ``libmpi`` and the hydra
  launcher, relocatable, 13 MiB; it starts 2 processes as root with no network, even with the
  loopback interface down).  ``wheels/`` is ignored by git: carry it to the GPU machine.
* ``python -m bench.nccl_tests_build build --out DIR`` (the GPU machine, offline, about a
  minute): unpacks both, then ``make -C src MPI=1`` for ``all_reduce_perf`` and ``sendrecv_perf``
  only (nccl-tests' src/Makefile and src/common.mk at the tag: ``MPI_HOME``, ``NCCL_HOME``,
  ``CUDA_HOME``, ``CUDA_LIB``, ``NVCC_GENCODE``, ``BUILDDIR``), against the libnccl ncclpy loads
  (CuPy's, from the nvidia-nccl wheel: its ``lib/`` has ``libnccl.so.2`` and no ``libnccl.so``,
  so ``NCCL_HOME`` is a folder of links).  ``DIR/build.json`` says what was built against what;
  :mod:`bench.nccl_tests_side` reads it.

Anything missing (no nvcc, no make, no C++ compiler, no carried source or wheel) raises
:class:`NotRunnable` with what is missing and what would supply it; a make that fails or does
not finish raises :class:`BuildFailed` with the end of its log (a failure, not a missing
prerequisite: the selftest records it as failed).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["NotRunnable", "BuildFailed", "Cuda", "Nccl", "BuildInfo", "TAG", "VERSION",
           "TAG_COMMIT", "MPICH", "BINARIES", "DEFAULT_CARRY", "prepare", "find_cuda",
           "find_nccl", "find_carried", "nccl_library", "extract_source", "extract_wheel",
           "gencode_for", "make_command", "build", "load_build", "tail", "main"]

log = logging.getLogger(__name__)

VERSION = "2.19.6"
TAG = f"v{VERSION}"
#: ``git rev-parse v2.19.6^{commit}`` in github.com/NVIDIA/nccl-tests
TAG_COMMIT = "a0b82b2260cf5152b9f8c061bbf7eaf0ba096432"
MPICH = ("mpich", "5.0.2")
#: the two nccl-tests programs the comparison runs
BINARIES = ("all_reduce_perf", "sendrecv_perf")
DEFAULT_CARRY = "wheels/nccl-tests"
TARBALL = f"nccl-tests-{VERSION}.tar.gz"
GITHUB_TARBALL = f"https://github.com/NVIDIA/nccl-tests/archive/refs/tags/{TAG}.tar.gz"
DEFAULT_REPO = "/work/.mirror/NVIDIA+nccl-tests/repo"
_TAIL_LINES = 25


class NotRunnable(Exception):
    """What stops nccl-tests from being built or run here (a missing prerequisite), said
    precisely."""


class BuildFailed(Exception):
    """nccl-tests' make failed or did not finish: the reason with the end of its log."""


@dataclass(frozen=True)
class Cuda:
    """The CUDA toolkit the build uses: its root, nvcc, and the folder with libcudart."""

    home: str
    nvcc: str
    lib: str
    version: str


@dataclass(frozen=True)
class Nccl:
    """The libnccl ncclpy loads (the file, its folder, nccl.h's folder, the version code)."""

    library: str
    include: str
    version: int


@dataclass
class BuildInfo:
    """``build.json``: what was built, against what, and how long it took."""

    tag: str
    binaries: Dict[str, str]
    mpi_home: str
    mpiexec: str
    nccl_library: str
    nccl_version: int
    cuda_home: str
    cuda_version: str
    gencode: str
    ld_library_path: List[str]
    seconds: float
    command: List[str] = field(default_factory=list)
    reused: bool = False


def tail(text: str, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------ prepare
def prepare(dest: str, *, repo: Optional[str] = None, tarball: Optional[str] = None,
            python: str = sys.executable, timeout_s: float = 300.0) -> Dict[str, object]:
    """Fill ``dest`` with nccl-tests' source tarball and MPICH's wheel; its manifest (also
    written to ``dest/MANIFEST.json``).  NotRunnable when neither a clone nor a tarball is at
    hand, or pip cannot download the wheel."""
    os.makedirs(dest, exist_ok=True)
    out = os.path.join(dest, TARBALL)
    if tarball:
        shutil.copyfile(tarball, out)
    elif not os.path.isfile(out):
        repo = repo or os.environ.get("NCCL_TESTS_REPO") or DEFAULT_REPO
        if not os.path.isdir(repo):
            raise NotRunnable(f"no clone of nccl-tests at {repo} (--repo) and no --tarball: "
                              f"download {GITHUB_TARBALL} and pass it as --tarball")
        try:
            commit = subprocess.run(["git", "-C", repo, "rev-parse", f"{TAG}^{{commit}}"],
                                    capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            raise NotRunnable(f"git cannot read {repo}: {e}") from None
        if commit.returncode != 0 or commit.stdout.strip() != TAG_COMMIT:
            raise NotRunnable(f"{repo}: tag {TAG} is {commit.stdout.strip() or 'missing'} "
                              f"({tail(commit.stderr, 2)}), expected {TAG_COMMIT}")
        r = subprocess.run(["git", "-C", repo, "archive", "--format=tar.gz",
                            f"--prefix=nccl-tests-{VERSION}/", "-o", os.path.abspath(out), TAG],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise NotRunnable(f"git archive {TAG} failed: {tail(r.stderr, 5)}")
    name, version = MPICH
    wheels = glob.glob(os.path.join(glob.escape(dest), f"{name}-{version}-*.whl"))
    if not wheels:
        cmd = [python, "-m", "pip", "download", f"{name}=={version}", "--no-deps",
               "--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64", "-d", dest]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NotRunnable(f"pip download {name}=={version} failed: {e}") from None
        wheels = glob.glob(os.path.join(glob.escape(dest), f"{name}-{version}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise NotRunnable(f"pip download {name}=={version} failed: {tail(r.stderr, 5)}")
    files = {os.path.basename(p): {"bytes": os.path.getsize(p), "sha256": _sha256(p)}
             for p in (out, wheels[0])}
    manifest: Dict[str, object] = {"nccl_tests": TAG, "nccl_tests_commit": TAG_COMMIT,
                                   "mpi": f"{name} {version}", "files": files}
    with open(os.path.join(dest, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


# ------------------------------------------------------------------------------ locate
def _site_nvcc() -> List[str]:
    """CUDA toolkits installed as pip wheels (``nvidia/cu13``, ``nvidia/cuda_nvcc``)."""
    out = []
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths().get(key)
        if site:
            out += sorted(os.path.dirname(os.path.dirname(p))
                          for p in glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvcc")))
    return out


def _cuda_lib(home: str) -> Optional[str]:
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        d = os.path.join(home, sub)
        if glob.glob(os.path.join(glob.escape(d), "libcudart.so*")):
            return d
    return None


def find_cuda(env: Optional[Mapping[str, str]] = None,
              defaults: Sequence[str] = ("/usr/local/cuda",)) -> Cuda:
    """The CUDA toolkit to build with: ``CUDA_HOME``/``CUDA_PATH``, the folder above the nvcc on
    ``PATH`` (through links; a wrapper script there is looked through to ``/usr/local/cuda``),
    ``/usr/local/cuda``, a pip CUDA toolkit; the first with ``bin/nvcc``, ``cuda_runtime.h`` and
    ``libcudart``.  NotRunnable naming what was looked at."""
    env = os.environ if env is None else env
    cands: List[str] = [env[v] for v in ("CUDA_HOME", "CUDA_PATH") if env.get(v)]
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cands += list(defaults) + _site_nvcc()
    seen = []
    for home in dict.fromkeys(cands):
        seen.append(home)
        exe = os.path.join(home, "bin", "nvcc")
        lib = _cuda_lib(home)
        if os.path.isfile(exe) and lib and os.path.isfile(
                os.path.join(home, "include", "cuda_runtime.h")):
            try:
                v = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                   timeout=60).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            release = next((ln.split("release ", 1)[1].split(",")[0] for ln in v.splitlines()
                            if "release " in ln), "?")
            return Cuda(home, exe, lib, release)
    raise NotRunnable(f"no CUDA toolkit with nvcc, cuda_runtime.h and libcudart (nvcc on PATH: "
                      f"{nvcc or 'none'}; looked in {', '.join(seen)}): nccl-tests is built "
                      f"with nvcc; install the CUDA toolkit or set CUDA_HOME")


_NCCL_PROBE = ("import json\nfrom ncclpy._nccl.lib import get_lib\nlib = get_lib()\n"
               "print(json.dumps({'path': lib.path, 'version': lib.version}))\n")


def nccl_library(python: str = sys.executable, timeout_s: float = 120.0,
                 env: Optional[Mapping[str, str]] = None) -> Tuple[str, int]:
    """(the libnccl file ncclpy binds, its version code), asked in a child process so that this
    one loads no NCCL; NotRunnable with ncclpy's reason when it cannot load one."""
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # ncclpy's checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    try:
        r = subprocess.run([python, "-c", _NCCL_PROBE], capture_output=True, text=True,
                           timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NotRunnable(f"cannot ask ncclpy which libnccl it loads: {e}") from None
    try:
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        path, version = str(doc["path"]), int(doc["version"])
    except (ValueError, IndexError, KeyError, TypeError):
        raise NotRunnable(f"ncclpy cannot load libnccl here (exit {r.returncode}): "
                          f"{tail(r.stderr, 3) or r.stdout.strip()[-300:]}") from None
    return path, version


def find_nccl(python: str = sys.executable, timeout_s: float = 120.0,
              env: Optional[Mapping[str, str]] = None) -> Nccl:
    """The libnccl ncclpy binds (CuPy's copy, :func:`nccl_library`); its ``nccl.h`` must be in
    ``../include`` (the nvidia-nccl wheels have it)."""
    path, version = nccl_library(python, timeout_s, env)
    inc = os.path.join(os.path.dirname(os.path.dirname(path)), "include")
    if not os.path.isfile(os.path.join(inc, "nccl.h")):
        raise NotRunnable(f"no nccl.h beside the libnccl ncclpy loads ({path}; looked in {inc})"
                          f": nccl-tests needs NCCL's headers of the same version")
    return Nccl(path, inc, version)


def _header_version(include: str) -> int:
    """``NCCL_VERSION_CODE`` of ``include/nccl.h``; NotRunnable without one."""
    try:
        with open(os.path.join(include, "nccl.h")) as f:
            for line in f:
                if line.startswith("#define NCCL_VERSION_CODE"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    raise NotRunnable(f"no NCCL_VERSION_CODE in {os.path.join(include, 'nccl.h')}")


def find_carried(carry: str) -> Dict[str, str]:
    """``{"source": tarball, "mpi_wheel": wheel}`` in the carry folder; NotRunnable saying how
    to prepare it."""
    how = (f"prepare it on a machine with network (python -m bench.nccl_tests_build prepare "
           f"--dest {DEFAULT_CARRY}) and carry wheels/ to this one")
    if not os.path.isdir(carry):
        raise NotRunnable(f"no carry folder {carry}: {how}")
    src = os.path.join(carry, TARBALL)
    wheels = sorted(glob.glob(os.path.join(glob.escape(carry), f"{MPICH[0]}-{MPICH[1]}-*.whl")))
    missing = ([TARBALL] if not os.path.isfile(src) else []) + \
        ([f"{MPICH[0]}-{MPICH[1]}-*.whl"] if not wheels else [])
    if missing:
        raise NotRunnable(f"{carry} lacks {' and '.join(missing)}: {how}")
    return {"source": src, "mpi_wheel": wheels[-1]}


# ------------------------------------------------------------------------------ unpack
def extract_source(tarball: str, dest: str) -> str:
    """Unpack nccl-tests' tarball into ``dest``; the folder holding ``src/Makefile``."""
    os.makedirs(dest, exist_ok=True)
    try:
        with tarfile.open(tarball) as tar:
            for m in tar.getmembers():
                if m.name.startswith("/") or ".." in m.name.split("/") or \
                        not (m.isfile() or m.isdir()):
                    continue            # only plain files and folders, inside dest
                tar.extract(m, dest)
    except (OSError, tarfile.TarError) as e:
        raise NotRunnable(f"cannot unpack {tarball}: {e}") from None
    for top in sorted(os.listdir(dest)):
        if os.path.isfile(os.path.join(dest, top, "src", "Makefile")):
            return os.path.join(dest, top)
    raise NotRunnable(f"{tarball} holds no nccl-tests tree (no */src/Makefile)")


def extract_wheel(wheel: str, dest: str) -> str:
    """Unpack MPICH's wheel into ``dest`` keeping the files' modes (zipfile drops them); the
    MPI root (its ``*.data/data`` folder: bin, include, lib)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if info.filename.startswith("/") or ".." in info.filename.split("/"):
                    continue
                path = z.extract(info, dest)
                mode = (info.external_attr >> 16) & 0o7777
                if mode and not info.is_dir():
                    os.chmod(path, mode | stat.S_IRUSR)
    except (OSError, zipfile.BadZipFile) as e:
        raise NotRunnable(f"cannot unpack {wheel}: {e}") from None
    roots = glob.glob(os.path.join(glob.escape(dest), "*.data", "data"))
    if not roots or not os.path.isfile(os.path.join(roots[0], "include", "mpi.h")):
        raise NotRunnable(f"{wheel} has no */data/include/mpi.h: not an MPI wheel")
    return roots[0]


def gencode_for(env: Optional[Mapping[str, str]] = None, timeout_s: float = 30.0) -> str:
    """``-gencode=arch=compute_XY,code=sm_XY`` for GPU 0 (nvidia-smi's compute capability);
    sm_90 (H100/H200) when it cannot be read."""
    cc = ""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=timeout_s,
                           env=None if env is None else dict(env))
        cc = r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    digits = cc.replace(".", "") if cc.replace(".", "").isdigit() else "90"
    return f"-gencode=arch=compute_{digits},code=sm_{digits}"


def _links(folder: str, targets: Mapping[str, str]) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, target in targets.items():
        p = os.path.join(folder, name)
        if os.path.lexists(p):
            os.remove(p)
        os.symlink(target, p)
    return folder


def make_command(src: str, out: str, *, mpi_home: str, nccl_home: str, cuda: Cuda,
                 cuda_lib: str, gencode: str, jobs: int) -> List[str]:
    """nccl-tests' make line for the two programs (src/Makefile's targets are
    ``$(BUILDDIR)/<name>_perf``).  ``CXXSTD=-std=c++17`` is given: src/common.mk picks it from
    ``which $(NVCC)`` and the CUDA release, and falls back to c++14 (which CUDA 13's headers
    refuse) on a machine without ``which``."""
    return ["make", "-C", os.path.join(src, "src"), f"-j{jobs}", "MPI=1",
            f"MPI_HOME={mpi_home}", f"NCCL_HOME={nccl_home}", f"CUDA_HOME={cuda.home}",
            f"CUDA_LIB={cuda_lib}", f"NVCC={cuda.nvcc}", f"NVCC_GENCODE={gencode}",
            "CXXSTD=-std=c++17", f"BUILDDIR={out}"] + [os.path.join(out, b) for b in BINARIES]


def load_build(out: str) -> Optional[BuildInfo]:
    """``out/build.json`` when it names binaries that exist; else None."""
    try:
        with open(os.path.join(out, "build.json")) as f:
            doc = json.load(f)
        info = BuildInfo(**{k: v for k, v in doc.items() if k in BuildInfo.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None
    return info if all(os.access(p, os.X_OK) for p in info.binaries.values()) else None


def build(carry: str, out: str, *, python: str = sys.executable, timeout_s: float = 240.0,
          gencode: Optional[str] = None, jobs: Optional[int] = None,
          env: Optional[Mapping[str, str]] = None, nccl: Optional[Nccl] = None) -> BuildInfo:
    """Build ``all_reduce_perf`` and ``sendrecv_perf`` into ``out`` (reusing a build there made
    against the same libnccl); NotRunnable with what is missing; BuildFailed, with the end of
    its log, for a make that failed or did not finish (the whole log is ``out/build.log``).
    ``nccl``: another libnccl than ncclpy's."""
    env = dict(os.environ if env is None else env)
    carried = find_carried(carry)
    cuda = find_cuda(env)
    nccl = nccl or find_nccl(python, env=env)
    for tool in ("make", env.get("CXX") or "g++"):
        if shutil.which(tool, path=env.get("PATH")) is None:
            raise NotRunnable(f"no {tool} on PATH: nccl-tests' Makefile needs make and a C++ "
                              f"compiler (CXX, default g++)")
    gencode = gencode or gencode_for(env)
    old = load_build(out)
    if old and old.nccl_library == nccl.library and old.gencode == gencode:
        old.reused = True
        return old
    t0 = time.monotonic()
    os.makedirs(out, exist_ok=True)
    src = extract_source(carried["source"], os.path.join(out, "src"))
    mpi = extract_wheel(carried["mpi_wheel"], os.path.join(out, "mpi"))
    links = {"libnccl.so": nccl.library}
    cuda_lib = cuda.lib
    if not os.path.exists(os.path.join(cuda.lib, "libcudart.so")):   # only libcudart.so.13
        real = sorted(glob.glob(os.path.join(glob.escape(cuda.lib), "libcudart.so.*")))
        links["libcudart.so"] = real[0]
        cuda_lib = os.path.join(out, "nccl_home", "lib")
    nccl_home = os.path.join(out, "nccl_home")
    _links(os.path.join(nccl_home, "lib"), links)
    _links(nccl_home, {"include": nccl.include})
    cmd = make_command(src, out, mpi_home=mpi, nccl_home=nccl_home, cuda=cuda,
                       cuda_lib=cuda_lib, gencode=gencode,
                       jobs=jobs or max(1, min(16, os.cpu_count() or 1)))
    logp = os.path.join(out, "build.log")
    with open(logp, "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:                        # make's compilers too, also when we are interrupted
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    with open(logp, errors="replace") as f:
        text = f.read()
    if rc != 0:
        what = f"did not finish in {timeout_s:.0f} s" if rc is None else f"failed (exit {rc})"
        raise BuildFailed(f"building nccl-tests {TAG} {what}; the end of {logp}:\n"
                          f"{tail(text)}")
    bins = {b: os.path.join(out, b) for b in BINARIES}
    info = BuildInfo(tag=TAG, binaries=bins, mpi_home=mpi,
                     mpiexec=os.path.join(mpi, "bin", "mpiexec"), nccl_library=nccl.library,
                     nccl_version=nccl.version, cuda_home=cuda.home, cuda_version=cuda.version,
                     gencode=gencode,
                     ld_library_path=[os.path.dirname(nccl.library), os.path.join(mpi, "lib"),
                                      cuda.lib],
                     seconds=round(time.monotonic() - t0, 1), command=cmd)
    with open(os.path.join(out, "build.json"), "w") as f:
        json.dump(asdict(info), f, indent=1)
        f.write("\n")
    return info


# ------------------------------------------------------------------------------ CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m bench.nccl_tests_build prepare|build``: 0 done, 1 could not, 2 usage."""
    from ncclpy.cli_util import OneLineParser, exit_status
    p = OneLineParser(prog="python -m bench.nccl_tests_build",
                      description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="step", required=True, metavar="prepare|build")
    pp = sub.add_parser("prepare", help="fill the carry folder (needs network or a clone)")
    pp.add_argument("--dest", default=DEFAULT_CARRY, help=f"default {DEFAULT_CARRY}")
    pp.add_argument("--repo", default=None, help=f"a clone of nccl-tests (default "
                    f"$NCCL_TESTS_REPO or {DEFAULT_REPO})")
    pp.add_argument("--tarball", default=None, help=f"nccl-tests {TAG}'s source tarball instead "
                    f"of a clone (e.g. {GITHUB_TARBALL})")
    pb = sub.add_parser("build", help="build the two programs (needs nvcc, make, g++)")
    pb.add_argument("--carry", default=DEFAULT_CARRY, help=f"default {DEFAULT_CARRY}")
    pb.add_argument("--out", required=True, help="the build folder")
    pb.add_argument("--timeout", type=float, default=240.0, help="seconds (default 240)")
    pb.add_argument("--gencode", default=None, metavar="CC",
                    help="the compute capability to build for, e.g. 90 or 9.0 (default: GPU "
                         "0's, nvidia-smi; 90 when it cannot say)")
    pb.add_argument("--nccl-lib", default=None, metavar="LIBNCCL",
                    help="build against this libnccl.so.2 (its ../include/nccl.h) instead of "
                         "the one ncclpy loads: for checking another NCCL's headers")
    try:
        ns = p.parse_args(argv)
        cc = (getattr(ns, "gencode", None) or "").replace(".", "").replace("sm_", "")
        if cc and not cc.isdigit():
            p.error(f"--gencode: expected a compute capability such as 90 or 9.0, got "
                    f"{ns.gencode!r}")
    except SystemExit as e:
        return exit_status(e)
    try:
        if ns.step == "prepare":
            m = prepare(ns.dest, repo=ns.repo, tarball=ns.tarball)
            size = sum(int(f["bytes"]) for f in m["files"].values())  # type: ignore[union-attr]
            print(f"{ns.dest}: {', '.join(m['files'])} ({size / (1 << 20):.1f} MiB); carry "
                  f"wheels/ to the GPU machine")
        else:
            nccl = None
            if ns.nccl_lib:
                inc = os.path.join(os.path.dirname(os.path.dirname(
                    os.path.abspath(ns.nccl_lib))), "include")
                nccl = Nccl(os.path.abspath(ns.nccl_lib), inc, _header_version(inc))
            gencode = f"-gencode=arch=compute_{cc},code=sm_{cc}" if cc else None
            info = build(ns.carry, ns.out, timeout_s=ns.timeout, gencode=gencode, nccl=nccl)
            how = "reused" if info.reused else f"built in {info.seconds:.0f} s"
            print(f"nccl-tests {info.tag} {how}: {', '.join(info.binaries.values())} (NCCL "
                  f"{info.nccl_version}, CUDA {info.cuda_version}, {info.gencode})")
    except (NotRunnable, BuildFailed) as e:
        sys.stderr.write(f"python -m bench.nccl_tests_build {ns.step}: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
