# Sourced by the launch scripts: creates .venv on first use and installs jaxmoe into it.
#   JAXMOE_EXTRAS=test  also installs the test oracles (torch CPU, transformers, torchao, pytest, ruff).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
spec="."
[ -n "${JAXMOE_EXTRAS:-}" ] && spec=".[${JAXMOE_EXTRAS}]"
stamp=".venv/.installed-${JAXMOE_EXTRAS:-base}-$(cat pyproject.toml | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  # torch==2.13.0 resolves to the CPU wheel on this machine; never let a range pull a CUDA build.
  .venv/bin/python -m pip install -q -e "$spec"
  touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
# glibc: a fixed 1 MiB mmap threshold, so that every large block freed goes back to the OS. By
# default glibc raises the threshold after large frees, and `jaxmoe convert`, which reads, stacks and
# drops thousands of MB-sized tensors, then peaks with the model's size instead of its largest tensor.
# jaxmoe itself never tunes malloc; launchers set it.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1048576}"
