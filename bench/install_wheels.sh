#!/usr/bin/env bash
# Install nccl4py (bench.overhead's optional backend) offline, from the wheels in wheels/, and
# only what does not import already: nccl4py, cuda-core, and where missing or too old
# cuda-bindings 13.x, cuda-pathfinder >= 1.5.4 and packaging.  Nothing is installed when
# `import nccl.core` works.  The wheels are not in git (wheels/ is ignored): fetch them on a
# machine with network, for the target's Python (cp312 here), e.g.
#   pip download nccl4py==0.6.0 cuda-core==1.2.2 'cuda-bindings==13.*' 'cuda-pathfinder>=1.5.4,<2' \
#       packaging --no-deps --only-binary :all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d wheels
# and carry wheels/ along to the GPU machine.
#
# Usage: bash bench/install_wheels.sh [--optional] [--python PY] [--wheels DIR]
#   --optional   exit 0 even when nccl4py cannot be installed (said on one line): the overhead
#                bench then runs without it (what the selftest uses)
#   --python PY  the interpreter to install for (default python3)
#   --wheels DIR where the wheels are (default wheels/ at the repository root)
# Exit status: 0 nccl4py imports (or --optional), 1 it could not be installed, 2 bad usage.
set -u
prog="bench/install_wheels.sh"
optional=0
py=python3
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/wheels"
while [ $# -gt 0 ]; do
    case "$1" in
        --optional) optional=1 ;;
        --python|--wheels)
            if [ $# -lt 2 ]; then
                echo "$prog: error: $1: expected a value after it" >&2; exit 2
            fi
            if [ "$1" = "--python" ]; then py="$2"; else dir="$2"; fi
            shift ;;
        -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "$prog: error: unknown argument '$1' (expected --optional, --python PY," \
                "--wheels DIR)" >&2; exit 2 ;;
    esac
    shift
done

give_up() {
    if [ "$optional" = 1 ]; then
        echo "$prog: nccl4py not installed: $1; bench.overhead runs without it (--optional)"
        exit 0
    fi
    echo "$prog: nccl4py not installed: $1" >&2
    exit 1
}

command -v "$py" >/dev/null 2>&1 || give_up "no interpreter '$py'"
ready() { "$py" -c 'import nccl.core' >/dev/null 2>&1; }
if ready; then
    echo "$prog: nccl4py already imports: $("$py" -c 'import nccl.core as n; print(n.__version__)')"
    exit 0
fi
[ -d "$dir" ] || give_up "no wheels folder $dir (see this script's header for how to fetch it)"

# which wheels this interpreter needs: one path per line, or "ERROR: why"
need="$("$py" - "$dir" <<'EOF'
import glob, importlib, os, sys

d = sys.argv[1]
tag = "cp%d%d" % sys.version_info[:2]


def version(mod):
    try:
        m = importlib.import_module(mod)
    except Exception:
        return None
    return str(getattr(m, "__version__", "0"))


def at_least(v, lo):
    try:
        return tuple(int(x) for x in v.split(".")[:3]) >= lo
    except ValueError:
        return False


want = []
v = version("cuda.pathfinder")
if v is None or not at_least(v, (1, 5, 4)):
    want.append("cuda_pathfinder")
v = version("cuda.bindings")
if v is None or not v.startswith("13."):
    want.append("cuda_bindings")
if version("packaging") is None:
    want.append("packaging")
if version("cuda.core") is None:
    want.append("cuda_core")
want.append("nccl4py")
for name in want:
    hits = [p for p in sorted(glob.glob(os.path.join(d, name + "-*.whl")))
            if "-py3-none-any" in p or "-%s-%s-" % (tag, tag) in p]
    if not hits:
        print("ERROR: no %s wheel for %s (py3 or %s) in %s" % (name, tag, tag, d))
        sys.exit(0)
    print(hits[-1])
EOF
)"
case "$need" in
    ERROR:*|"") give_up "${need#ERROR: }" ;;
esac
mapfile -t files <<< "$need"
echo "$prog: installing offline: $(for f in "${files[@]}"; do basename "$f"; done | tr '\n' ' ')"
log="$(mktemp)"
if ! "$py" -m pip install --no-index --no-deps --quiet "${files[@]}" >"$log" 2>&1; then
    if grep -q "externally-managed-environment" "$log"; then
        echo "$prog: this Python is marked externally managed; installing with" \
             "--break-system-packages (a lent, throw-away machine)"
        "$py" -m pip install --no-index --no-deps --quiet --break-system-packages \
            "${files[@]}" >"$log" 2>&1 || { tail -5 "$log" >&2; rm -f "$log"; give_up "pip failed"; }
    else
        tail -5 "$log" >&2; rm -f "$log"; give_up "pip failed"
    fi
fi
rm -f "$log"
ready || give_up "installed, but 'import nccl.core' still fails: $("$py" -c 'import nccl.core' 2>&1 | tail -1)"
"$py" -c 'import nccl.core as n; v = n.get_version(); print("bench/install_wheels.sh: nccl4py", v.nccl4py, "imports; libnccl", v.libnccl)'
