#!/usr/bin/env bash
# Build jaxcomm with its CUDA module and run the GPU tests and benchmark, in
# one command, on a machine with an NVIDIA GPU, nvcc, cmake and a CUDA-enabled
# jax in python3, but no MPI and no network.
#
#   tests/gpu/run.sh WHEEL_DIR [OUT_DIR]
#
# WHEEL_DIR comes from tests/gpu/prepare_wheels.sh. OUT_DIR (default
# ./gpu-run-<date>) receives summary.md and one log per step. Every step runs
# even after an earlier one failed; the exit status is non-zero if any did.
#
# Environment: PYTHON (python3), VENV (/tmp/jaxcomm-gpu-venv, rebuilt each
# run), TEST_TIMEOUT (600 s per pytest run), BENCH_TIMEOUT (600 s),
# PYTEST_ARGS (extra pytest arguments, e.g. -m 'not large'), BENCH_ARGS
# (extra benchmark arguments, e.g. --quick), BUILD_ARGS (extra pip arguments
# for the build, e.g. -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90), MPS
# (auto: the tests and the benchmark run under CUDA MPS where
# nvidia-cuda-mps-control exists; 0: never), SKIP (log names of steps to
# leave out, without .log, e.g. "pytest-n1 pytest-n2 overlap"; the set-up
# steps always run).
set -uo pipefail

if [[ $# -lt 1 || $# -gt 2 || $1 == -h || $1 == --help ]]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
wheel_dir=$(realpath "$1")
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

if [[ ! -d $wheel_dir ]] || ! compgen -G "$wheel_dir/mpich-*.whl" >/dev/null; then
  echo "error: $wheel_dir holds no mpich wheel; make it with tests/gpu/prepare_wheels.sh" >&2
  exit 2
fi

steps=()     # "name|status|log" for the summary
failures=0
after_setup=0  # SKIP applies from the versions step on

# step NAME LOG COMMAND...: run COMMAND, its output to the terminal and LOG.
step() {
  local name=$1 log=$2
  shift 2
  if ((after_setup)) && [[ " ${SKIP:-} " == *" ${log%.log} "* ]]; then
    steps+=("$name|skipped (SKIP)|$log")
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
  "${pip[@]}" --ignore-installed --no-deps mpich mpi4py || return
  # The rest only where missing.
  "${pip[@]}" pytest-mpi pybind11 scikit-build-core pytest || return
  # mpi4jax, for the benchmark's side-by-side columns, where its wheel came.
  if compgen -G "$wheel_dir/mpi4jax-*.whl" >/dev/null; then
    "${pip[@]}" --no-deps mpi4jax || return
  fi
}

check_mpi() {
  command -v mpicc mpiexec || return
  mpicc -show
  # mpi4py's wheel picks a libmpi at run time: it must be the mpich wheel's.
  python -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0]);
print("thread level", MPI.Query_thread(), "of", MPI.THREAD_MULTIPLE);
print("mpi4py loaded", *sorted({l.split()[-1] for l in open("/proc/self/maps") if "libmpi" in l}))'
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

gpu_tests() {
  local ranks=$1
  # Each rank writes its own JUnit file: the summary counts per rank.
  (cd "$repo" && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$test_timeout" \
    mpiexec -n "$ranks" bash -c 'exec python -m pytest --with-mpi -p no:cacheprovider -q -rs \
      --junitxml="$0/junit-n$1-rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}.xml" "${@:2}" tests/gpu' \
    "$out_dir" "$ranks" "${pytest_args[@]}")
}

# The benchmarks run from / : the source tree's jaxcomm has no kernels.
# mpi4jax's CUDA module links the CUDA runtime dynamically.
gpu_bench() {
  (cd / && XLA_PYTHON_CLIENT_PREALLOCATE=false \
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(cuda_runtime_dirs)" \
    timeout "$bench_timeout" mpiexec -n "$1" python -m jaxcomm.bench.gpu "${@:2}")
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

# jaxcomm.bench.overlap on the default device, the GPU: 16 MiB only, which
# every GPU holds twice per rank.
overlap() {
  (cd / && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$bench_timeout" \
    mpiexec -n 2 python -m jaxcomm.bench.overlap --mib 16 --repeats 5)
}

step "virtual environment" venv.log make_venv
export PATH="$venv/bin:$PATH"
step "wheels" wheels.log install_wheels
step "MPI from the mpich wheel" mpi.log check_mpi
find_nvcc
step "build with JAXCOMM_CUDA=ON" build.log build
after_setup=1
step "versions" versions.log versions
step "cuda_info" cuda_info.log cuda_info
step "JAX sees a GPU" jax_gpu.log jax_gpu
step "8 B loop, 1 rank" latency-n1.log latency 1 n1 hlo
step "8 B loop, 2 ranks sharing the GPU" latency-n2.log latency 2 n2
step "CUDA MPS daemon" mps.log mps_start
if [[ -f $out_dir/mps-on ]]; then
  step "8 B loop, 2 ranks under MPS" latency-n2-mps.log latency 2 n2-mps
fi
step "GPU benchmark, 2 ranks" benchmark.log benchmark
step "GPU tests, 1 rank" pytest-n1.log gpu_tests 1
step "GPU tests, 2 ranks" pytest-n2.log gpu_tests 2
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
print("## GPU tests\n")
print("| ranks | rank | tests | passed | failed | errors | skipped | seconds |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for path in sorted(glob.glob(os.path.join(out, "junit-n*-rank*.xml"))):
    ranks, rank = re.search(r"junit-n(\d+)-rank(\d+)", path).groups()
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    print(f"| {ranks} | {rank} | {n['tests']} | {passed} | {n['failures']} | {n['errors']} "
          f"| {n['skipped']} | {float(suite.get('time', 0)):.0f} |")
skips = sorted({m.group(1) for log in ("pytest-n1.log", "pytest-n2.log")
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
print("\n## Nonblocking overlap (2 ranks, python -m jaxcomm.bench.overlap)\n")
print("```\n" + "\n".join(read("overlap.log").splitlines()[-6:]) + "\n```")
EOF
cat "$out_dir/summary.md"
echo
echo "summary and logs: $out_dir"
exit $((failures > 0))
