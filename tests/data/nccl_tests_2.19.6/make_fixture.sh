#!/usr/bin/env bash
# Rebuild this folder's JSON fixtures from nccl-tests 2.19.6's own writer: src/util.cu taken
# from the git tag and compiled unchanged (with its headers and os/linux.cc), driven by
# driver.cu (stub device queries, the driver's values), linked against a real libnccl for
# ncclGetVersion and ncclGetLastError.  Also copies nccl-tests' tools/analyze_perf_json.py and
# LICENSE.txt from the same tag (the test runs that script on ncclpy's JSON).  No GPU needed.
#
#   NCCL_TESTS_REPO=<a clone of github.com/NVIDIA/nccl-tests> tests/data/nccl_tests_2.19.6/make_fixture.sh
#
# Needs git, nvcc, a C++ compiler and NCCL's headers and library (NCCL_HOME, default: the pip
# package nvidia-nccl-cu13).
set -euo pipefail

TAG=v2.19.6
TAG_COMMIT=a0b82b2260cf5152b9f8c061bbf7eaf0ba096432
UTIL_BLOB=fa5ac3ef2b6ade93ac453aa44febab43a67045f3      # git rev-parse v2.19.6:src/util.cu

REPO=${NCCL_TESTS_REPO:-/work/.mirror/NVIDIA+nccl-tests/repo}
NVCC=${NVCC:-nvcc}
CXX=${CXX:-g++}
NCCL_HOME=${NCCL_HOME:-$(python -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

commit=$(git -C "$REPO" rev-parse "$TAG^{commit}")
[ "$commit" = "$TAG_COMMIT" ] || { echo "$TAG is $commit, expected $TAG_COMMIT" >&2; exit 1; }
blob=$(git -C "$REPO" rev-parse "$TAG:src/util.cu")
[ "$blob" = "$UTIL_BLOB" ] || { echo "$TAG:src/util.cu is $blob, expected $UTIL_BLOB" >&2; exit 1; }

for f in src/util.cu src/util.h src/common.h src/nccl1_compat.h src/timer.h os/os.h os/linux.cc; do
  mkdir -p "$work/$(dirname "$f")"
  git -C "$REPO" show "$TAG:$f" > "$work/$f"
done
git -C "$REPO" show "$TAG:tools/analyze_perf_json.py" > "$here/analyze_perf_json.py"
git -C "$REPO" show "$TAG:LICENSE.txt" > "$here/LICENSE.txt"

# nccl-tests' own flags for its .cu files (src/common.mk: NVCUFLAGS, CUDA 13: c++17)
flags=(-std=c++17 -DNCCL_OS_LINUX -I"$work/src" -I"$work/os" -I"$NCCL_HOME/include")
"$NVCC" "${flags[@]}" -c "$work/src/util.cu" -o "$work/util.o"
"$NVCC" "${flags[@]}" -c "$here/driver.cu" -o "$work/driver.o"
"$CXX" -std=c++17 -DNCCL_OS_LINUX -I"$work/os" -c "$work/os/linux.cc" -o "$work/linux.o"
"$NVCC" -cudart none -o "$work/driver" "$work/driver.o" "$work/util.o" "$work/linux.o" \
  -L"$NCCL_HOME/lib" -l:libnccl.so.2 -Xlinker -rpath="$NCCL_HOME/lib"

cd "$work"                              # jsonOutputInit never overwrites: write fresh files
./driver all_reduce_perf.json 0 > all_reduce_perf.txt
./driver all_reduce_perf_per_iter.json 1 > all_reduce_perf_per_iter.txt
for f in all_reduce_perf.json all_reduce_perf_per_iter.json; do
  python -c 'import json, sys; json.load(open(sys.argv[1]))' "$f"
  cp "$f" "$here/$f"
done
echo "wrote $here/all_reduce_perf.json and $here/all_reduce_perf_per_iter.json"
