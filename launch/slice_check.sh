# Sourced by launch/tpu_vm.sh and launch/gke/launch.sh: the checks a launcher makes on this machine
# before it creates or submits anything.
#
#   slice_check PROG PREFLIGHT ARG...
#
# runs `jaxmoe compile ARG... --mesh-only` (ARG: --config FILE, --topology or --accelerator-type,
# --slices, --config.KEY=VALUE): the config's mesh must have one device per chip of the slice, else
# the launcher stops naming both. With PREFLIGHT=1 it then compiles the train step for the slice
# (`jaxmoe compile ARG... --check`, XLA:TPU through libtpu, on this CPU) and stops when the step
# does not fit a chip's HBM. Everything it prints goes to stderr. The interpreter is $JAXMOE_PYTHON,
# else this checkout's .venv (bash launch/local.sh makes it), else python3.

slice_check() {
  local prog=$1 preflight=$2
  shift 2
  local root py rc=0
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  py=${JAXMOE_PYTHON:-}
  if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
  fi
  jaxmoe_here() {
    (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" "$@")
  }
  if ! jaxmoe_here -c 'import jaxmoe.topology' 2>/dev/null; then
    echo "$prog: checking the config's mesh against the slice needs jaxmoe importable by $py:" \
      "run 'bash launch/local.sh' once (it makes $root/.venv) or set JAXMOE_PYTHON; nothing was created" >&2
    exit 1
  fi
  jaxmoe_here -m jaxmoe compile "$@" --mesh-only >/dev/null || {
    echo "$prog: the config is refused for this slice (above); nothing was created" >&2
    exit 1
  }
  [ "$preflight" = 1 ] || return 0
  echo "$prog: preflight: compiling the train step for the slice on this machine (jaxmoe compile)" >&2
  jaxmoe_here -m jaxmoe compile "$@" --check >&2 || rc=$?
  case "$rc" in
    0) echo "$prog: preflight: the train step fits (the JSON line above)" >&2 ;;
    3)
      echo "$prog: preflight: the train step does not fit a chip (the JSON line above); nothing was created" >&2
      exit 1
      ;;
    *)
      echo "$prog: preflight: jaxmoe compile failed (status $rc, above); nothing was created" >&2
      exit 1
      ;;
  esac
}
