#!/usr/bin/env bash
# Train jaxmoe on a Cloud TPU VM slice: create the slice (a TPU VM, or a queued resource with
# --queued), install jaxmoe on every worker, run `jaxmoe train` on all workers with their logs
# streamed here, and delete the slice at the end. When the slice is preempted it is deleted,
# recreated and the run started again; `jaxmoe train` resumes from the last good checkpoint in
# --workdir, which therefore has to be a gs:// path every worker sees.
#
#   launch/tpu_vm.sh --name jaxmoe-v5p --zone us-east5-a --accelerator-type v5p-4096 \
#       --workdir gs://BUCKET/jaxmoe/target --queued \
#       --config.mesh.data=1 --config.mesh.fsdp=128 --config.mesh.expert=16
#
# Before it creates anything it checks, on this machine, that the config's mesh has one device per
# chip of the slice (and with --preflight compiles the train step for the slice and stops unless it
# fits; launch/slice_check.sh). --dry-run prints the gcloud commands, one per line after "+ ",
# quoted so they can be pasted into a shell, and runs nothing on Google Cloud. Bad or missing
# flags exit with status 2, a config that does not match or fit the slice with 1. See docs/tpu.md.
set -euo pipefail

PROG="launch/tpu_vm.sh"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh --name NAME --zone ZONE --accelerator-type TYPE --workdir gs://BUCKET/PATH [flags]
                        [--config.KEY=VALUE ...]

Creates a Cloud TPU slice, installs jaxmoe on all its workers, runs
`jaxmoe train --config CONFIG --workdir WORKDIR [--config.KEY=VALUE ...]` on all of them
(jax.distributed.initialize() finds the other workers by itself), streams their logs and deletes
the slice at the end. On preemption the slice is deleted and recreated and training resumes from
the last checkpoint in WORKDIR.

Required:
  --name NAME               TPU (and queued resource) name: lowercase letters, digits, '-'
  --zone ZONE               e.g. us-east5-a (v5p), us-east5-b or europe-west4-a (v6e)
  --accelerator-type TYPE   e.g. v5p-128, v5p-4096, v6e-256, v5litepod-16, v4-32
  --workdir gs://B/P        checkpoints and metrics; must be gs:// (all workers share it)

Optional:
  --project PROJECT         Google Cloud project (default: gcloud's core/project)
  --version VERSION         TPU runtime (default from the type: v6e v2-alpha-tpuv6e, v5p v2-alpha-tpuv5,
                            v5litepod v2-alpha-tpuv5-lite, v2/v3/v4 tpu-ubuntu2204-base)
  --config FILE             config file in the repository (default configs/target.py)
  --steps N                 passed on as --config.steps=N
  --config.KEY=VALUE        passed on to jaxmoe train unchanged (repeatable)
  --queued                  create a queued resource and wait until it is ACTIVE
  --spot                    spot capacity (cheaper, preemptible)
  --reserved                use the project's reserved capacity
  --repo URL                git repository to install (default: this checkout's 'origin' remote)
  --branch BRANCH           branch or tag to install (default: this checkout's branch, else main)
  --python PYTHON           interpreter on the workers, >= 3.11 (default python3.11; apt-installed if missing)
  --max-restarts N          recreate at most N times after preemptions (default 3)
  --poll-seconds S          seconds between queued-resource state checks (default 30)
  --keep                    do not delete the slice at the end
  --preflight               compile the train step for the slice here first (jaxmoe compile, needs
                            libtpu: pip install -e '.[tpu]') and stop unless it fits a chip
  --dry-run                 print the gcloud commands (prefixed "+ ") and run nothing

The config's mesh must have one device per chip of the slice (v5p-N and v4-N have N/2 chips,
v5litepod-N and v6e-N have N); the launcher checks it before it creates anything.
  -h, --help                this text
EOF
}

usage_error() {
  echo "$PROG: error: $*" >&2
  echo "Run '$PROG --help' for the flags." >&2
  exit 2
}

die() {
  echo "$PROG: $*" >&2
  exit 1
}

# One shell word that pastes back as the same argument: bare when only safe characters are in it,
# else single-quoted.
shell_word() {
  local s=$1 sq="'" esc="'\\''"
  if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//"$sq"/"$esc"}"
  fi
}

shell_line() {
  local out="" a
  for a in "$@"; do
    out+="${out:+ }$(shell_word "$a")"
  done
  printf '%s' "$out"
}

# --------------------------------------------------------------------------------------------
# Flags

name="" zone="" project="" accel="" version="" workdir="" config="configs/target.py"
steps="" repo="" branch="" python="python3.11" max_restarts=3 poll_seconds=30
queued=0 spot=0 reserved=0 keep=0 dry_run=0 preflight=0
overrides=()

while [ $# -gt 0 ]; do
  arg=$1
  shift
  case "$arg" in
    --config.*=*)
      overrides+=("$arg")
      continue
      ;;
    --config.*)
      usage_error "$arg needs a value: write $arg=VALUE"
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    --queued | --spot | --reserved | --keep | --dry-run | --preflight)
      case "$arg" in
        --preflight) preflight=1 ;;
        --queued) queued=1 ;;
        --spot) spot=1 ;;
        --reserved) reserved=1 ;;
        --keep) keep=1 ;;
        --dry-run) dry_run=1 ;;
      esac
      continue
      ;;
    --*=*)
      flag=${arg%%=*}
      value=${arg#*=}
      ;;
    --*)
      flag=$arg
      if [ $# -eq 0 ] || [[ "$1" == --* ]]; then
        value=""
      else
        value=$1
        shift
      fi
      ;;
    *)
      usage_error "unexpected argument '$arg' (flags start with --)"
      ;;
  esac
  case "$flag" in
    --name | --zone | --project | --accelerator-type | --version | --workdir | --config | --steps | \
      --repo | --branch | --python | --max-restarts | --poll-seconds) ;;
    *) usage_error "unknown flag $flag" ;;
  esac
  [ -n "$value" ] || usage_error "$flag needs a value"
  case "$flag" in
    --name) name=$value ;;
    --zone) zone=$value ;;
    --project) project=$value ;;
    --accelerator-type) accel=$value ;;
    --version) version=$value ;;
    --workdir) workdir=$value ;;
    --config) config=$value ;;
    --steps) steps=$value ;;
    --repo) repo=$value ;;
    --branch) branch=$value ;;
    --python) python=$value ;;
    --max-restarts) max_restarts=$value ;;
    --poll-seconds) poll_seconds=$value ;;
  esac
done

[ -n "$name" ] || usage_error "--name is required"
[[ "$name" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  usage_error "--name '$name' must be lowercase letters, digits and '-', starting with a letter"
[ -n "$zone" ] || usage_error "--zone is required"
[[ "$zone" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || usage_error "--zone '$zone' is not a zone like us-east5-a"
[ -n "$accel" ] || usage_error "--accelerator-type is required"
[[ "$accel" =~ ^v[0-9]+[a-z]*-[0-9]+$ ]] ||
  usage_error "--accelerator-type '$accel' is not a TPU type like v5p-128, v6e-256, v5litepod-16 or v4-32"
[ -n "$workdir" ] || usage_error "--workdir is required"
[[ "$workdir" =~ ^gs://[^/]+ ]] ||
  usage_error "--workdir '$workdir' must be a gs:// path: every worker writes and resumes from it"
if [ -n "$project" ] && ! [[ "$project" =~ ^[a-z][-a-z0-9.:]*[a-z0-9]$ ]]; then
  usage_error "--project '$project' is not a project id"
fi
if [ -n "$steps" ] && ! [[ "$steps" =~ ^[1-9][0-9]*$ ]]; then
  usage_error "--steps '$steps' must be a positive integer"
fi
[[ "$max_restarts" =~ ^[0-9]+$ ]] || usage_error "--max-restarts '$max_restarts' must be an integer >= 0"
[[ "$poll_seconds" =~ ^[0-9]+$ ]] || usage_error "--poll-seconds '$poll_seconds' must be an integer >= 0"
[[ "$python" =~ ^[A-Za-z0-9_./-]+$ ]] || usage_error "--python '$python' is not an interpreter name"

if [ -z "$version" ]; then
  case "$accel" in
    v6e-*) version=v2-alpha-tpuv6e ;;
    v5p-*) version=v2-alpha-tpuv5 ;;
    v5litepod-*) version=v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) version=tpu-ubuntu2204-base ;;
    *) usage_error "--version is required: no default runtime for --accelerator-type $accel" ;;
  esac
fi
if [ -z "$repo" ]; then
  repo=$(git -C "$ROOT" remote get-url origin 2>/dev/null) ||
    usage_error "--repo is required: $ROOT has no 'origin' remote to install from"
fi
if [ -z "$branch" ]; then
  branch=$(git -C "$ROOT" rev-parse --abbrev-ref HEAD 2>/dev/null) || branch=main
  [ "$branch" != HEAD ] || branch=main
fi

# --------------------------------------------------------------------------------------------
# The config against the slice, here, before anything is created

# shellcheck source=launch/slice_check.sh
source "$ROOT/launch/slice_check.sh"
check_args=(--config "$config" --accelerator-type "$accel")
[ -z "$steps" ] || check_args+=("--config.steps=$steps")
check_args+=("${overrides[@]+"${overrides[@]}"}")
slice_check "$PROG" "$preflight" "${check_args[@]}"

# --------------------------------------------------------------------------------------------
# Commands

scope=(--zone="$zone")
[ -z "$project" ] || scope+=(--project="$project")
capacity=()
[ "$spot" = 0 ] || capacity+=(--spot)
[ "$reserved" = 0 ] || capacity+=(--reserved)

# What every worker runs. Plain POSIX sh: it is executed by the worker's login shell.
# shellcheck disable=SC2088  # the tilde is for the worker's shell, not this one
remote_dir='~/jaxmoe'
install_cmd="set -eu; command -v $python >/dev/null || { sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $python $python-venv; }; if [ -d $remote_dir/.git ]; then git -C $remote_dir fetch -q $(shell_word "$repo") $(shell_word "$branch") && git -C $remote_dir checkout -q --force FETCH_HEAD; else git clone -q --branch $(shell_word "$branch") $(shell_word "$repo") $remote_dir; fi; cd $remote_dir; [ -x .venv/bin/python ] || $python -m venv .venv; .venv/bin/pip install -q --upgrade pip; .venv/bin/pip install -q -e '.[gcs]'; .venv/bin/pip install -q \"jax[tpu]==\$(.venv/bin/python -c 'import jax; print(jax.__version__)')\""
train_args=(train --config "$config" --workdir "$workdir")
[ -z "$steps" ] || train_args+=("--config.steps=$steps")
train_args+=("${overrides[@]+"${overrides[@]}"}")
train_cmd="cd $remote_dir && exec .venv/bin/jaxmoe $(shell_line "${train_args[@]}")"

# Runs a command (printed to stderr first), or with --dry-run only prints it to stdout.
run() {
  if [ "$dry_run" = 1 ]; then
    printf '+ %s\n' "$(shell_line "$@")"
    return 0
  fi
  printf '+ %s\n' "$(shell_line "$@")" >&2
  "$@"
}

create_cmd() {
  if [ "$queued" = 1 ]; then
    run gcloud compute tpus queued-resources create "$name" "${scope[@]}" --node-id="$name" \
      --accelerator-type="$accel" --runtime-version="$version" "${capacity[@]+"${capacity[@]}"}"
  else
    run gcloud compute tpus tpu-vm create "$name" "${scope[@]}" \
      --accelerator-type="$accel" --version="$version" "${capacity[@]+"${capacity[@]}"}"
  fi
}

queued_state() {
  gcloud compute tpus queued-resources describe "$name" "${scope[@]}" --format='value(state.state)'
}

# State of the TPU node (READY when healthy); empty when it is gone.
node_state() {
  gcloud compute tpus tpu-vm describe "$name" "${scope[@]}" --format='value(state)' 2>/dev/null || true
}

on_all_workers() {
  run gcloud compute tpus tpu-vm ssh "$name" "${scope[@]}" --worker=all --command="$1"
}

delete_cmd() {
  if [ "$queued" = 1 ]; then
    run gcloud compute tpus queued-resources delete "$name" "${scope[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$name" "${scope[@]}" --quiet
  fi
}

if [ "$dry_run" = 1 ]; then
  create_cmd
  if [ "$queued" = 1 ]; then
    # Polled every --poll-seconds until it prints ACTIVE.
    printf '+ %s\n' "$(shell_line gcloud compute tpus queued-resources describe "$name" "${scope[@]}" \
      --format='value(state.state)')"
  fi
  on_all_workers "$install_cmd"
  on_all_workers "$train_cmd"
  [ "$keep" = 1 ] || delete_cmd
  exit 0
fi

command -v gcloud >/dev/null || die "gcloud not found on PATH (install the Google Cloud CLI)"

created=0
cleanup() {
  local rc=$?
  set +e
  if [ "$created" = 1 ]; then
    if [ "$keep" = 1 ]; then
      echo "$PROG: keeping $name (--keep); delete it with: $(shell_line "${delete_argv[@]}")" >&2
    else
      delete_cmd || echo "$PROG: deleting $name failed; delete it by hand" >&2
    fi
  fi
  exit "$rc"
}
if [ "$queued" = 1 ]; then
  delete_argv=(gcloud compute tpus queued-resources delete "$name" "${scope[@]}" --force --quiet)
else
  delete_argv=(gcloud compute tpus tpu-vm delete "$name" "${scope[@]}" --quiet)
fi
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Creates the slice; with --queued waits until the queued resource is ACTIVE.
provision() {
  create_cmd || die "creating $name failed (see gcloud's message above)"
  created=1
  [ "$queued" = 1 ] || return 0
  local state
  while :; do
    state=$(queued_state 2>/dev/null) || state=UNKNOWN
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED) die "queued resource $name is FAILED; see: gcloud compute tpus queued-resources describe $name --zone=$zone" ;;
    esac
    echo "$PROG: queued resource $name is ${state:-UNKNOWN}; waiting for ACTIVE" >&2
    sleep "$poll_seconds"
  done
}

restarts=0
while :; do
  provision
  if on_all_workers "$install_cmd" && on_all_workers "$train_cmd"; then
    echo "$PROG: training finished on $name; checkpoints and metrics are in $workdir" >&2
    break
  fi
  state=$(node_state)
  if [ "$state" = READY ]; then
    die "installing or training failed on $name, which is READY (not a preemption); see the log above"
  fi
  if [ "$restarts" -ge "$max_restarts" ]; then
    die "$name is ${state:-gone} after $restarts restarts; giving up (--max-restarts $max_restarts)"
  fi
  restarts=$((restarts + 1))
  echo "$PROG: $name is ${state:-gone} (preempted); recreating it, restart $restarts of $max_restarts;" \
    "training resumes from the last checkpoint in $workdir" >&2
  delete_cmd || echo "$PROG: deleting $name failed; trying to recreate it anyway" >&2
  created=0
done
