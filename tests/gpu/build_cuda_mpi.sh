#!/usr/bin/env bash
# Build a CUDA-aware MPI (Open MPI 4.1.4, from Debian bookworm's source
# package) into PREFIX, stripped to what the GPU runs need, and mpi4py wheels
# against it. Run it on a Debian bookworm x86-64 machine with network, nvcc
# and a C compiler (not on the GPU machine, whose time is scarce); the GPU
# machine then gets PREFIX through tests/gpu/prepare_carry.sh.
#
#   tests/gpu/build_cuda_mpi.sh PREFIX [WORK_DIR]
#
# PREFIX is an absolute path (default place: /opt/jaxcomm-ompi-cuda); the
# GPU run puts the carried copy back at the same path, so the wrappers and
# the run paths baked into libraries and wheels stay right. WORK_DIR (default
# /tmp/jaxcomm-cuda-mpi-build) holds the sources and the build tree. Where
# PREFIX already holds a build made by this script with the same settings,
# the build is skipped and only the checks run.
#
# Environment: CUDA_HOME (/usr/local/cuda), JOBS (make's -j, 2), NICE (19),
# MPI4PY_PYTHONS (the Pythons to build mpi4py wheels for; default the
# newest pyenv 3.12 under /root/.pyenv, the GPU machine's version, else
# python3), MPI4PY_VERSION (4.1.2), WHEEL_DIR (WORK_DIR/wheels), SKIP_CHECKS
# (1: no smoke test).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || $1 == -h || $1 == --help ]]; then
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
prefix=$1
[[ $prefix == /* ]] || { echo "error: PREFIX must be an absolute path" >&2; exit 2; }
work=${2:-/tmp/jaxcomm-cuda-mpi-build}
cuda=${CUDA_HOME:-/usr/local/cuda}
jobs=${JOBS:-2}
nice=(nice -n "${NICE:-19}")
wheel_dir=${WHEEL_DIR:-$work/wheels}
mpi4py_version=${MPI4PY_VERSION:-4.1.2}

ompi_version=4.1.4
debian_version=4.1.4-3
# What the runs need: one node, shared memory (smcuda carries CUDA IPC), TCP
# for completeness. No Fortran, C++ bindings, Java, OpenSHMEM or ROMIO (the
# ompio component still provides MPI-IO), no network fabrics; hwloc, libevent
# and PMIx built in, since the GPU machine has none of them.
configure_flags=(
  --with-cuda="$cuda"
  --disable-mpi-fortran --disable-mpi-cxx --disable-mpi-java --disable-oshmem
  --disable-io-romio --disable-static --enable-shared
  --without-ucx --without-verbs --without-ofi --without-psm --without-psm2
  --without-knem --without-xpmem --without-slurm --without-tm
  --with-hwloc=internal --with-libevent=internal --with-pmix=internal
  --disable-dependency-tracking --enable-silent-rules
)
cuda_version=$("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
stamp_text="openmpi $debian_version cuda $cuda_version ${configure_flags[*]}"
stamp=$prefix/.jaxcomm-build
pythons=()
if [[ -n ${MPI4PY_PYTHONS:-} ]]; then
  read -r -a pythons <<<"$MPI4PY_PYTHONS"
elif compgen -G '/root/.pyenv/versions/3.12*/bin/python3' >/dev/null; then
  pythons=("$(compgen -G '/root/.pyenv/versions/3.12*/bin/python3' | tail -n 1)")
else
  pythons=(python3)
fi

# The source package: a deb-src line for bookworm main beside the deb one,
# in the deb822 format the image uses.
fetch_source() {
  if ! grep -rqsE '^(deb-src .*bookworm.* main|Types:.*deb-src)' \
    /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "adding a deb-src entry for bookworm main"
    cat >/etc/apt/sources.list.d/jaxcomm-deb-src.sources <<SOURCES
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    apt-get update -q
  fi
  mkdir -p "$work/src"
  # apt checks the files against the signed Sources index.
  if [[ ! -f $work/src/openmpi_$ompi_version.orig.tar.xz ]]; then
    (cd "$work/src" && apt-get source --download-only "openmpi=$debian_version")
  fi
  # Debian's own patches are packaging (library paths, pkg-config, man page
  # macros, ports to hppa, ia64 and hurd): the upstream tree builds as it is.
  rm -rf "$work/openmpi-$ompi_version"
  tar -xf "$work/src/openmpi_$ompi_version.orig.tar.xz" -C "$work"
}

build_mpi() {
  local tree=$work/openmpi-$ompi_version
  local start=$SECONDS
  rm -rf "$prefix"
  (cd "$tree" && "${nice[@]}" ./configure --prefix="$prefix" "${configure_flags[@]}" \
    >"$work/configure.log" 2>&1) || { tail -n 40 "$work/configure.log"; return 1; }
  grep -q '^#define OPAL_CUDA_SUPPORT 1' "$tree/opal/include/opal_config.h" || {
    echo "error: configure did not enable CUDA (see $work/configure.log)" >&2
    return 1
  }
  (cd "$tree" && "${nice[@]}" make -j"$jobs" >"$work/make.log" 2>&1) ||
    { tail -n 40 "$work/make.log"; return 1; }
  (cd "$tree" && make install >"$work/install.log" 2>&1) ||
    { tail -n 40 "$work/install.log"; return 1; }
  echo "built in $(((SECONDS - start) / 60)) min; installed: $(du -sh "$prefix" | cut -f1)"
  prune
  echo "$stamp_text" >"$stamp"
}

# Keep what running and building against the MPI needs: the libraries, the
# components, the help and wrapper data files in share/openmpi, mpicc and
# mpiexec with the daemon they start, and ompi_info.
prune() {
  rm -rf "$prefix/share/man" "$prefix/share/doc" "$prefix/lib/pkgconfig"
  find "$prefix/lib" -name '*.la' -delete
  find "$prefix/lib" -name '*.a' -delete
  local file
  while IFS= read -r -d '' file; do
    if [[ $(head -c 4 "$file" | od -An -c | tr -d ' ') == 177ELF ]]; then
      strip --strip-unneeded "$file"
    fi
  done < <(find "$prefix/bin" "$prefix/lib" -type f -print0)
  echo "after stripping: $(du -sh "$prefix" | cut -f1)"
}

# mpi4py from source, against this MPI, for each Python.
mpi4py_wheels() {
  if ((${#pythons[@]} == 0)); then
    echo "no Python to build mpi4py for" >&2
    return 1
  fi
  mkdir -p "$wheel_dir"
  local python tag
  for python in "${pythons[@]}"; do
    tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if compgen -G "$wheel_dir/mpi4py-$mpi4py_version-$tag-*.whl" >/dev/null &&
      [[ $wheel_dir/.built-against -nt $stamp ]]; then
      echo "mpi4py $mpi4py_version for $tag: already built"
      continue
    fi
    rm -f "$wheel_dir"/mpi4py-*-"$tag"-*.whl
    # Stripped: the wheel travels, its debug information need not.
    MPICC=$prefix/bin/mpicc CFLAGS="-O2 -g0" LDFLAGS="-Wl,--strip-all" \
      "${nice[@]}" "$python" -m pip wheel --quiet --disable-pip-version-check \
      --no-cache-dir --no-binary mpi4py --no-deps -w "$wheel_dir" "mpi4py==$mpi4py_version"
    echo "mpi4py $mpi4py_version for $tag: built"
  done
  touch "$wheel_dir/.built-against"
}

check() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  "$prefix/bin/ompi_info" --parsable --all | grep -q 'mpi_built_with_cuda_support:value:true' ||
    { echo "error: ompi_info says this Open MPI is not CUDA-aware" >&2; return 1; }
  echo "ompi_info: mpi_built_with_cuda_support:value:true"
  "$prefix/bin/ompi_info" | grep -E 'btl: smcuda|coll: cuda' | sed 's/^ */ompi_info: /'
  local tmp
  tmp=$(mktemp -d)
  cat >"$tmp/query.c" <<'C'
#include <mpi.h>
#include <mpi-ext.h>
#include <stdio.h>
int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  if (rank == 0) printf("MPIX_CUDA_AWARE_SUPPORT 1, MPIX_Query_cuda_support() %d\n",
                        MPIX_Query_cuda_support());
#else
  if (rank == 0) printf("MPIX_CUDA_AWARE_SUPPORT not set\n");
#endif
  MPI_Finalize();
  return 0;
}
C
  "$prefix/bin/mpicc" -o "$tmp/query" "$tmp/query.c"
  timeout 120 "$prefix/bin/mpiexec" --oversubscribe -n 2 "$tmp/query"
  # The mpi4py wheel just built, in a throwaway environment: 2 ranks agree.
  local python=${pythons[0]} tag
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  "$python" -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install --quiet --disable-pip-version-check --no-index --no-deps \
    "$wheel_dir"/mpi4py-"$mpi4py_version"-"$tag"-*.whl
  timeout 120 "$prefix/bin/mpiexec" --oversubscribe -n 2 "$tmp/venv/bin/python" -c '
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1)
assert total == comm.size * (comm.size + 1) // 2, total
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libmpi.so" in line}
print(f"mpi4py rank {comm.rank} of {comm.size}: allreduce {total};",
      MPI.Get_library_version().splitlines()[0].strip("\0 "), "from", *sorted(maps))'
  rm -rf "$tmp"
}

if [[ -f $stamp && $(cat "$stamp") == "$stamp_text" && -x $prefix/bin/mpicc ]]; then
  echo "$prefix already holds Open MPI $ompi_version with CUDA $cuda_version: not rebuilt"
else
  fetch_source
  build_mpi
fi
mpi4py_wheels
if [[ ${SKIP_CHECKS:-0} != 1 ]]; then
  check
fi
echo "size: $(du -sh "$prefix" | cut -f1) in $prefix; mpi4py wheels in $wheel_dir:"
ls -s "$wheel_dir"/mpi4py-*.whl
