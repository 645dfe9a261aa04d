#!/usr/bin/env bash
# Build jaxcomm with its CUDA module and run the GPU tests and benchmark, in
# one command, on a machine with an NVIDIA GPU, nvcc, cmake and a CUDA-enabled
# jax in python3, but no MPI and no network.
#
#   tests/gpu/run.sh CARRY_DIR [OUT_DIR]
#
# CARRY_DIR comes from tests/gpu/prepare_carry.sh: a CUDA-aware MPI in mpi/
# and wheels built against it in wheels/ (the direct path and host staging
# both run); or a folder of wheels from tests/gpu/prepare_wheels.sh with the
# mpich wheel (host staging only). OUT_DIR (default ./gpu-run-<date>)
# receives summary.md and one log per step. Every step runs even after an
# earlier one failed; the exit status is non-zero if any did.
#
# Environment: PYTHON (python3), VENV (/tmp/jaxcomm-gpu-venv, rebuilt each
# run), DEADLINE (seconds from the start by which the summary is written:
# each step's timeout is cut to fit, and a step with under 30 s left is
# skipped; default none), TEST_TIMEOUT (600 s per pytest run), BENCH_TIMEOUT
# (600 s), PYTEST_ARGS (extra pytest arguments, e.g. -m 'not large'),
# BENCH_ARGS (extra benchmark arguments, e.g. --quick), BUILD_ARGS (extra pip
# arguments for the build), MPS (auto: the steps after "CUDA MPS daemon" run
# under CUDA MPS where nvidia-cuda-mps-control exists; 0: never), SKIP (log
# names of steps to leave out, without .log, e.g. "pytest-n1 overlap"; the
# set-up steps always run).
set -uo pipefail

if [[ $# -lt 1 || $# -gt 2 || $1 == -h || $1 == --help ]]; then
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
started=$SECONDS
carry_dir=$(realpath "$1")
out_dir=${2:-gpu-run-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out_dir" && out_dir=$(realpath "$out_dir")
repo=$(realpath "$(dirname "$0")/../..")
python=${PYTHON:-python3}
venv=${VENV:-/tmp/jaxcomm-gpu-venv}
test_timeout=${TEST_TIMEOUT:-600}
bench_timeout=${BENCH_TIMEOUT:-600}
# Shell words, so that PYTEST_ARGS="-m 'not large'" keeps its quotes.
eval "pytest_args=(${PYTEST_ARGS:-})"
eval "bench_args=(${BENCH_ARGS:-})"
eval "build_args=(${BUILD_ARGS:-})"

# A carried MPI goes back to the absolute path it was built for, which its
# wrappers, its help files and the run paths of the wheels built against it
# name; the mpich wheel needs no such place.
if [[ -x $carry_dir/mpi/bin/mpicc && -f $carry_dir/mpi/.jaxcomm-prefix ]]; then
  wheel_dir=$carry_dir/wheels
  mpi_prefix=$(cat "$carry_dir/mpi/.jaxcomm-prefix")
  mpi_name="the carried CUDA-aware MPI"
  # Open MPI refuses root unless told; the device machine runs commands as root.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
elif compgen -G "$carry_dir/mpich-*.whl" >/dev/null; then
  wheel_dir=$carry_dir
  mpi_prefix=
  mpi_name="the mpich wheel"
else
  echo "error: $carry_dir holds neither mpi/ with wheels/ (tests/gpu/prepare_carry.sh)" \
    "nor an mpich wheel (tests/gpu/prepare_wheels.sh)" >&2
  exit 2
fi

steps=()     # "name|status|log" for the summary
failures=0
after_setup=0  # SKIP applies from the versions step on

# Seconds a step may take: LIMIT, cut to what DEADLINE leaves once the
# summary's reserve is kept; 0 when that is under 30 s.
reserve=20
time_left() {
  local limit=$1
  if [[ -n ${DEADLINE:-} ]]; then
    local left=$((DEADLINE - (SECONDS - started) - reserve))
    ((left < limit)) && limit=$left
  fi
  ((limit < 30)) && limit=0
  echo "$limit"
}

# step NAME LOG COMMAND...: run COMMAND, its output to the terminal and LOG.
step() {
  local name=$1 log=$2
  shift 2
  if ((after_setup)) && [[ " ${SKIP:-} " == *" ${log%.log} "* ]]; then
    steps+=("$name|skipped (SKIP)|$log")
    return 0
  fi
  if ((after_setup)) && (($(time_left 30) == 0)); then
    steps+=("$name|skipped (DEADLINE)|$log")
    return 0
  fi
  echo
  echo "=== $name"
  "$@" 2>&1 | tee "$out_dir/$log"
  local status=${PIPESTATUS[0]}
  if ((status == 0)); then
    steps+=("$name|ok|$log")
  else
    steps+=("$name|FAILED (exit $status)|$log")
    failures=$((failures + 1))
    echo "=== $name: FAILED (exit $status)"
  fi
  return "$status"
}

make_venv() {
  rm -rf "$venv"
  "$python" -m venv --system-site-packages "$venv" || return
  # A python3 that is itself a virtual environment (as on images that ship
  # their CUDA jax in one) lends the new one only its base interpreter's
  # packages: point a .pth file at its own, after the new venv's.
  "$venv/bin/python" - "$python" <<'EOF'
import subprocess, sys, sysconfig, pathlib
parent = subprocess.run(
    [sys.argv[1], "-c", "import site, sys; print(sys.prefix != sys.base_prefix); "
     "print('\\n'.join(site.getsitepackages()))"],
    capture_output=True, text=True, check=True).stdout.split("\n")
if parent[0] == "True":
    pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "_parent_environment.pth"
    pth.write_text("\n".join(p for p in parent[1:] if p) + "\n")
    print(f"{sys.argv[1]} is a virtual environment: its packages come through {pth}")
EOF
  "$venv/bin/python" -c 'import jax; print("jax", jax.__version__, "from", jax.__file__)'
}

install_wheels() {
  local pip=("$venv/bin/python" -m pip install --disable-pip-version-check --no-index
             --find-links "$wheel_dir")
  if [[ -f $wheel_dir/SHA256SUMS ]]; then
    (cd "$wheel_dir" && sha256sum --check --quiet SHA256SUMS) || return
  fi
  # Ours, even where the system has an mpi4py: the kernels and mpi4py must
  # run the same MPI, the one whose mpicc builds the kernels.
  if [[ -n $mpi_prefix ]]; then
    "${pip[@]}" --ignore-installed --no-deps mpi4py || return
  else
    "${pip[@]}" --ignore-installed --no-deps mpich mpi4py || return
  fi
  # The rest only where missing.
  "${pip[@]}" pytest-mpi pybind11 scikit-build-core pytest || return
  # mpi4jax, for the benchmark's side-by-side columns, where its wheel came.
  if compgen -G "$wheel_dir/mpi4jax-*.whl" >/dev/null; then
    "${pip[@]}" --no-deps mpi4jax || return
  fi
}

# The carried MPI at its own path, first on PATH.
place_mpi() {
  if [[ -e $mpi_prefix && ! -L $mpi_prefix ]]; then
    echo "$mpi_prefix exists and is not a link to a carried MPI: left alone" >&2
    return 1
  fi
  mkdir -p "$(dirname "$mpi_prefix")" && ln -sfn "$carry_dir/mpi" "$mpi_prefix" || return
  echo "$mpi_prefix -> $carry_dir/mpi"
  cat "$carry_dir/mpi/.jaxcomm-build"
}

check_mpi() {
  command -v mpicc mpiexec || return
  mpicc -show
  # mpi4py picks a libmpi at run time: it must be the one mpicc builds with.
  python -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0]);
print("thread level", MPI.Query_thread(), "of", MPI.THREAD_MULTIPLE);
print("mpi4py loaded", *sorted({l.split()[-1] for l in open("/proc/self/maps") if "libmpi" in l}))'
  if [[ -n $mpi_prefix ]]; then
    ompi_info --parsable --all | grep 'mpi_built_with_cuda_support:value' || return
  fi
  timeout 120 mpiexec -n 2 python -c 'from mpi4py import MPI; c = MPI.COMM_WORLD;
assert c.allreduce(c.rank + 1) == 3; print("rank", c.rank, "of", c.size, "ok")'
}

find_nvcc() {
  if ! command -v nvcc >/dev/null; then
    for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
      if [[ -n $dir && -x $dir/bin/nvcc ]]; then
        export PATH="$PATH:$dir/bin"
        break
      fi
    done
  fi
  if command -v nvcc >/dev/null; then
    export CUDACXX=${CUDACXX:-$(command -v nvcc)}
  fi
}

build() {
  command -v nvcc || { echo "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)"; return 1; }
  nvcc --version | tail -n 2
  (cd "$repo" && python -m pip install --disable-pip-version-check --no-index \
    --no-build-isolation --no-deps --force-reinstall -v \
    -C cmake.define.JAXCOMM_CUDA=ON "${build_args[@]}" .) || return
  # pip succeeds also when CMake ignores JAXCOMM_CUDA: look for the module.
  in_out python -c 'import importlib.util as u, sys
spec = u.find_spec("jaxcomm._kernels_cuda")
print("CUDA module:", spec.origin if spec else "NOT BUILT (no jaxcomm._kernels_cuda)")
sys.exit(spec is None)'
}

# Python snippets run from OUT_DIR: in the source tree, `import jaxcomm`
# would find the package without its compiled modules.
in_out() { (cd "$out_dir" && "$@"); }

versions() {
  in_out python - <<'EOF'
import importlib.metadata as md, platform, re
from mpi4py import MPI
print("python", platform.python_version())
for name in ["jaxcomm", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt",
             "jax-cuda12-plugin", "jax-cuda12-pjrt", "mpi4py", "mpich", "numpy", "pytest",
             "pytest-mpi"]:
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        pass
print("MPI", MPI.Get_library_version().splitlines()[0].strip())
EOF
  command -v nvcc >/dev/null && echo "nvcc $(nvcc --version | sed -n 's/.*release \([^,]*\),.*/\1/p')"
  cmake --version | head -n 1
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
      sed 's/^/GPU /'
  else
    echo "nvidia-smi: not found"
  fi
  git -C "$repo" log -1 --format='jaxcomm commit %h %s' 2>/dev/null || true
  # A copied tree may carry changes its commit does not have.
  local changed
  changed=$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null | wc -l)
  ((changed == 0)) || echo "jaxcomm tree: $changed tracked files differ from that commit"
}

cuda_info() {
  in_out python -c 'import jaxcomm; print(jaxcomm.cuda_info())'
}

jax_gpu() {
  in_out python -c 'import jax, sys
try:
    print("JAX GPU devices:", jax.devices("gpu"))
except RuntimeError as err:
    sys.exit(f"JAX sees no GPU ({err}); the GPU tests will skip and the benchmark measures nothing")'
}

# gpu_tests RANKS NAME [PYTEST ARGUMENT...]: the GPU tests, each rank writing
# junit-NAME-rank<rank>.xml, so that the summary counts per rank.
gpu_tests() {
  local ranks=$1 name=$2
  (cd "$repo" && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(time_left "$test_timeout")" \
    mpiexec -n "$ranks" bash -c 'exec python -m pytest --with-mpi -p no:cacheprovider -q -rs \
      --junitxml="$0/junit-$1-rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}.xml" "${@:2}" tests/gpu' \
    "$out_dir" "$name" "${pytest_args[@]}" "${@:3}")
}

# direct_path NAME: did MPI get device pointers? tests/gpu/direct_path.py on
# 2 ranks, once forced onto the direct path and once onto host staging, with
# Open MPI's CUDA log on. The direct run must hold no staging memory and show
# Open MPI opening the peer's GPU buffers over CUDA IPC; the staging run
# must show neither.
direct_path() {
  local name=$1 path ipc status=0
  for path in direct staging; do
    (cd "$out_dir" && OMPI_MCA_mpi_common_cuda_verbose=10 OMPI_MCA_btl_smcuda_cuda_ipc_verbose=10 \
      JAXCOMM_CUDA_AWARE=$([[ $path == direct ]] && echo 1 || echo 0) \
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(time_left 120)" \
      mpiexec -n 2 python "$repo/tests/gpu/direct_path.py" "$path") \
      >"$out_dir/$name-$path.txt" 2>&1 || status=1
    grep -E '^rank [0-9]+:' "$out_dir/$name-$path.txt"
    ipc=$(grep -c 'cuIpcOpenMemHandle passed' "$out_dir/$name-$path.txt")
    echo "$path: Open MPI opened $ipc peer GPU buffers over CUDA IPC"
    grep -m 3 -E 'CUDA IPC (REQ|ACK)|ACCESS=|cuIpcOpenMemHandle passed|Library successfully opened' \
      "$out_dir/$name-$path.txt" | sed 's/^/  /'
    if [[ $path == direct && $ipc == 0 ]] || [[ $path == staging && $ipc != 0 ]]; then
      echo "$path: not the expected CUDA IPC activity"
      status=1
    fi
  done
  return "$status"
}

# The benchmarks run from the source tree's root, as python -m benchmarks.X,
# on the installed jaxcomm (see benchmarks/__init__.py). mpi4jax's CUDA module
# links the CUDA runtime dynamically; with a CUDA-aware MPI it hands MPI
# device pointers too (MPI4JAX_USE_CUDA_MPI=1).
gpu_bench() {
  (cd "$repo" && XLA_PYTHON_CLIENT_PREALLOCATE=false \
    MPI4JAX_USE_CUDA_MPI=${MPI4JAX_USE_CUDA_MPI:-$([[ -n $mpi_prefix ]] && echo 1 || echo 0)} \
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(cuda_runtime_dirs)" \
    timeout "$(time_left "$bench_timeout")" mpiexec -n "$1" python -m benchmarks.gpu "${@:2}")
}

cuda_runtime_dirs() {
  python - <<'EOF'
import glob, os, site
dirs = {os.path.dirname(p) for d in site.getsitepackages()
        for p in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.*"), recursive=True)}
dirs |= {d for d in ("/usr/local/cuda/lib64",) if glob.glob(d + "/libcudart.so.*")}
print(":".join(sorted(dirs)))
EOF
}

benchmark() { gpu_bench 2 --out "$out_dir/benchmark" "${bench_args[@]}"; }

# Where the 8 B loop's time goes: one rank alone, then two sharing the GPU
# (under MPS when it runs), each beside the C++ reference, mpi4jax, an empty
# loop and the handler clock; the first also writes the loop's HLO.
latency() {
  local ranks=$1 name=$2
  gpu_bench "$ranks" --latency-only --quick --label "$name" --out "$out_dir/latency-$name" \
    ${3:+--hlo "$out_dir/loop-hlo.txt"}
}

# CUDA MPS lets the ranks' kernels and copies share the GPU at once instead
# of time-slicing it between processes. The daemon and its clients use the
# default pipe directory. Says whether it runs in $out_dir/mps-on.
mps_start() {
  PATH="$PATH:/usr/local/cuda/bin"
  if [[ ${MPS:-auto} == 0 ]] || ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "MPS not used (MPS=${MPS:-auto}; nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo not found))"
    return 0
  fi
  nvidia-cuda-mps-control -d || return
  sleep 1
  # A client that connects proves the daemon serves.
  if timeout 120 python -c 'import jax; print("MPS up; JAX sees", jax.devices("gpu"))'; then
    touch "$out_dir/mps-on"
  else
    echo "no client could use the MPS daemon: stopped, running without it"
    echo quit | nvidia-cuda-mps-control
  fi
}

mps_stop() { echo quit | PATH="$PATH:/usr/local/cuda/bin" nvidia-cuda-mps-control; }

# benchmarks.overlap on the default device, the GPU: 16 MiB only, which
# every GPU holds twice per rank.
overlap() {
  (cd "$repo" && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(time_left "$bench_timeout")" \
    mpiexec -n 2 python -m benchmarks.overlap --mib 16 --repeats 5)
}

step "virtual environment" venv.log make_venv
export PATH="$venv/bin:$PATH"
if [[ -n $mpi_prefix ]]; then
  step "carried MPI at $mpi_prefix" place-mpi.log place_mpi
  export PATH="$mpi_prefix/bin:$PATH"
fi
step "wheels" wheels.log install_wheels
step "MPI: $mpi_name" mpi.log check_mpi
find_nvcc
step "build with JAXCOMM_CUDA=ON" build.log build
after_setup=1
step "versions" versions.log versions
step "cuda_info" cuda_info.log cuda_info
step "JAX sees a GPU" jax_gpu.log jax_gpu
# Without MPS first: what matters most comes first, since DEADLINE may stop
# the run before its end.
if [[ -n $mpi_prefix ]]; then
  step "MPI gets device pointers, 2 ranks sharing the GPU" direct-path.log direct_path direct-path
fi
step "8 B loop, 2 ranks sharing the GPU" latency-n2.log latency 2 n2
step "GPU tests, 2 ranks sharing the GPU" pytest-n2.log gpu_tests 2 n2
step "CUDA MPS daemon" mps.log mps_start
if [[ -f $out_dir/mps-on ]]; then
  if [[ -n $mpi_prefix ]]; then
    step "MPI gets device pointers, 2 ranks under MPS" direct-path-mps.log direct_path direct-path-mps
  fi
  step "8 B loop, 2 ranks under MPS" latency-n2-mps.log latency 2 n2-mps
fi
step "GPU benchmark, 2 ranks" benchmark.log benchmark
if [[ -f $out_dir/mps-on ]]; then
  # The direct path under MPS: the staging path ran under MPS before.
  step "GPU tests, 2 ranks under MPS, direct path" pytest-n2-mps.log gpu_tests 2 n2-mps \
    -k "not host"
fi
step "8 B loop, 1 rank" latency-n1.log latency 1 n1 hlo
step "GPU tests, 1 rank" pytest-n1.log gpu_tests 1 n1
step "nonblocking overlap on GPU arrays, 2 ranks" overlap.log overlap
if [[ -f $out_dir/mps-on ]]; then mps_stop; fi

python - "$out_dir" "$failures" "${steps[@]}" <<'EOF' >"$out_dir/summary.md"
import glob, os, re, sys
import xml.etree.ElementTree as ET

out, failures, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3:]


def read(name):
    path = os.path.join(out, name)
    return open(path, errors="replace").read().strip() if os.path.exists(path) else ""


print("# jaxcomm GPU run\n")
print(f"Result: **{'all steps passed' if not failures else f'{failures} step(s) failed'}**\n")
print("| step | status | log |\n| --- | --- | --- |")
for entry in steps:
    name, status, log = entry.split("|")
    print(f"| {name} | {status} | {log} |")
print("\n## Versions\n\n```\n" + read("versions.log") + "\n```\n")
print("## cuda_info\n\n```\n" + read("cuda_info.log") + "\n" + read("jax_gpu.log") + "\n```\n")
for name, what in (("direct-path", "2 ranks sharing the GPU"), ("direct-path-mps", "under MPS")):
    text = read(f"{name}.log")
    if text:
        print(f"## Does MPI get device pointers? ({what}, tests/gpu/direct_path.py)\n")
        print("```\n" + text + "\n```\n")
print("## GPU tests\n")
print("| run | rank | tests | passed | failed | errors | skipped | seconds |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for path in sorted(glob.glob(os.path.join(out, "junit-*-rank*.xml"))):
    run, rank = re.search(r"junit-(.+)-rank(\d+)\.xml$", path).groups()
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    print(f"| {run} | {rank} | {n['tests']} | {passed} | {n['failures']} | {n['errors']} "
          f"| {n['skipped']} | {float(suite.get('time', 0)):.0f} |")
skips = sorted({m.group(1) for log in ("pytest-n1.log", "pytest-n2.log", "pytest-n2-mps.log")
                for m in re.finditer(r"^SKIPPED \[\d+\] \S+?:\d+: (.*)$", read(log), re.M)})
if skips:
    print("\nSkip reasons:\n\n" + "\n".join(f"- {s}" for s in skips))
table = read("benchmark/table.md")
print("\n## Benchmark (2 ranks)\n")
print(table if table else "No benchmark table; the end of benchmark.log:\n\n```\n"
      + "\n".join(read("benchmark.log").splitlines()[-15:]) + "\n```")
print("\n## Where the 8 B loop's time goes\n")
for name, what in (("n1", "1 rank"), ("n2", "2 ranks sharing the GPU"),
                   ("n2-mps", "2 ranks under MPS")):
    text = read(f"latency-{name}/table.md")
    if text:
        print(f"{what}:\n\n{text}\n")
hlo = read("loop-hlo.txt")
if hlo:
    whiles = [line.strip()[:400] for line in hlo.splitlines() if " while(" in line]
    print("While loops in the compiled HLO of jaxcomm's loop (loop-hlo.txt):\n\n```\n"
          + "\n".join(whiles) + "\n```\n")
print("\n## Nonblocking overlap (2 ranks, python -m benchmarks.overlap)\n")
print("```\n" + "\n".join(read("overlap.log").splitlines()[-6:]) + "\n```")
EOF
cat "$out_dir/summary.md"
echo
echo "summary and logs: $out_dir"
exit $((failures > 0))
