#!/usr/bin/env bash
# Prepares, on a machine with the package index, what scripts/gpu/gpu_check.sh needs on a GPU
# machine that has none (docs/dev/gpu.md, "The device plan"):
#
#   bash scripts/gpu/gpu_check_prepare.sh [HOROVOD_CHECKOUT]
#
# .whl/      mpich and mpi4py for CPython 3.12 on x86-64 (the GPU check's MPI), and Intel MPI
#            (impi-rt==2021.14.0) made small enough to travel: the PyPI wheel is 78 MB, more than
#            a device call carries (64 MiB), mostly its tuning tool, tuning tables, benchmarks,
#            Fortran bindings and three extra copies of libmpi; the slim wheel keeps the
#            launcher, libmpi.so.12, libfabric with its providers and etc/ (about 20 MB).
# .horovod/  Horovod's CUDA Adasum tests (test/parallel/test_adasum_pytorch.py) and the one
#            helper scripts/horovod/horovod_suite.py links (horovod/runner/util/threads.py), copied
#            from HOROVOD_CHECKOUT: a working tree or a bare git directory (nothing is fetched).
#
# Both folders are ignored by git (.gitignore); a device call names them in `carry`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS="${WHEELS:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$WHEELS"
cd "$WHEELS"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_5_x86_64; do platforms+=(--platform "$p"); done
have() { ls $1 >/dev/null 2>&1; }
have 'mpich-*.whl' && have 'mpi4py-*cp312*.whl' ||
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d . mpich mpi4py
if ! have 'impi_rt-2021.14.0-1slim-*.whl'; then
  tmp="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$tmp" impi-rt==2021.14.0
  "$PY" - "$tmp"/impi_rt-2021.14.0-*.whl . <<'EOF'
import os, re, sys, zipfile
source, out_dir = sys.argv[1], sys.argv[2]
DROP = re.compile(r"data/data/(opt/|bin/IMB-|bin/cpuinfo$|lib/libmpifort|lib/libmpi\.so\.12\.0"
                  r"|lib/libfabric/prov/libpsm3|etc/tuning_.*\.dat$)")
name = os.path.basename(source).replace("-py2.py3-", "-1slim-py2.py3-", 1)
with zipfile.ZipFile(source) as zin, zipfile.ZipFile(os.path.join(out_dir, name), "w",
                                                     zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if DROP.search(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):   # the kept files' lines only
            data = b"".join(line + b"\n" for line in data.split(b"\n")
                            if line and not DROP.search(line.split(b",")[0].decode()))
        zout.writestr(info, data)
print(f"{name}: {os.path.getsize(os.path.join(out_dir, name)) / 2**20:.1f} MiB")
EOF
  rm -rf "$tmp"
fi
ls -l "$WHEELS"
if [ $# -ge 1 ]; then
  src="$1" dest="$ROOT/.horovod"
  files=(test/parallel/test_adasum_pytorch.py horovod/runner/util/threads.py)
  rm -rf "$dest"; mkdir -p "$dest"
  if [ -d "$src/.git" ] || [ -f "$src/.git" ] || [ ! -d "$src/test" ]; then
    git --git-dir="$( [ -d "$src/.git" ] && echo "$src/.git" || echo "$src")" archive HEAD \
      "${files[@]}" | tar -x -C "$dest"
  else
    (cd "$src" && cp --parents "${files[@]}" "$dest")
  fi
  echo "Horovod's tests in $dest: $(cd "$dest" && find . -type f | sort | tr '\n' ' ')"
fi
du -sh "$WHEELS" "$ROOT"/.horovod 2>/dev/null || true
