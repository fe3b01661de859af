#!/usr/bin/env bash
# Render launch/gke/jobset.yaml for a (multi-slice) TPU training run and `kubectl apply` it.
#
#   launch/gke/launch.sh --name jaxmoe-target --slices 2 --accelerator tpu-v5p-slice \
#       --topology 8x16x16 --image REGISTRY/jaxmoe:TAG --workdir gs://BUCKET/jaxmoe/target \
#       --config.mesh.data=2 --config.mesh.fsdp=128 --config.mesh.expert=16
#
# Before it submits anything it checks, on this machine, that the config's mesh has one device per
# chip of the slices (and with --preflight compiles the train step for them and stops unless it
# fits; launch/slice_check.sh). --dry-run prints the kubectl command (after "+ ") and the rendered
# manifest, and runs nothing on the cluster. Bad or missing flags exit with status 2, a config
# that does not match or fit the slices with 1. See docs/tpu.md.
set -euo pipefail

PROG="launch/gke/launch.sh"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEMPLATE="$HERE/jobset.yaml"
ACCELERATORS="tpu-v4-podslice tpu-v5-lite-podslice tpu-v5p-slice tpu-v6e-slice"

usage() {
  cat <<'EOF'
Usage: launch/gke/launch.sh --name NAME --accelerator ACCEL --topology TOPO --image IMAGE
                            --workdir gs://BUCKET/PATH [flags] [--config.KEY=VALUE ...]

Renders launch/gke/jobset.yaml (a JobSet with one child Job per TPU slice and one Pod per TPU VM)
and runs `kubectl apply -f -` with it. Every Pod runs
`jaxmoe train --config CONFIG --workdir WORKDIR [--config.KEY=VALUE ...]`; a failed Pod restarts
the JobSet and training resumes from the last checkpoint in WORKDIR.

Required:
  --name NAME           JobSet name: lowercase letters, digits, '-', at most 40 characters
  --accelerator ACCEL   node label cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice,
                        tpu-v6e-slice, tpu-v5-lite-podslice or tpu-v4-podslice
  --topology TOPO       node label cloud.google.com/gke-tpu-topology: AxBxC for v4/v5p (e.g. 8x16x16),
                        AxB for v5e/v6e (e.g. 16x16)
  --image IMAGE         container image with jaxmoe and jax[tpu] installed (launch/gke/Dockerfile)
  --workdir gs://B/P    checkpoints and metrics; must be gs:// (all Pods share it)

Optional:
  --slices N            number of TPU slices (node pools of the same accelerator and topology), default 1
  --config FILE         config file, relative to the image's working directory (default configs/target.py)
  --steps N             passed on as --config.steps=N
  --config.KEY=VALUE    passed on to jaxmoe train unchanged (repeatable)
  --max-restarts N      JobSet failurePolicy.maxRestarts (default 10)
  --preflight           compile the train step for the slices here first (jaxmoe compile, needs
                        libtpu: pip install -e '.[tpu]') and stop unless it fits a chip
  --dry-run             print the kubectl command and the manifest, run nothing

The config's mesh must have one device per chip of all the slices (SLICES x the topology's
chips); the launcher checks it before it submits anything. --config is checked in this checkout,
which must match the image.
  -h, --help            this text
EOF
}

usage_error() {
  echo "$PROG: error: $*" >&2
  echo "Run '$PROG --help' for the flags." >&2
  exit 2
}

# A YAML double-quoted scalar (its escapes are JSON's).
yaml_string() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}

# --------------------------------------------------------------------------------------------
# Flags

name="" accelerator="" topology="" image="" workdir="" config="configs/target.py" steps=""
slices=1 max_restarts=10 dry_run=0 preflight=0
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
    --dry-run)
      dry_run=1
      continue
      ;;
    --preflight)
      preflight=1
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
    --name | --accelerator | --topology | --image | --workdir | --config | --steps | --slices | --max-restarts) ;;
    *) usage_error "unknown flag $flag" ;;
  esac
  [ -n "$value" ] || usage_error "$flag needs a value"
  case "$flag" in
    --name) name=$value ;;
    --accelerator) accelerator=$value ;;
    --topology) topology=$value ;;
    --image) image=$value ;;
    --workdir) workdir=$value ;;
    --config) config=$value ;;
    --steps) steps=$value ;;
    --slices) slices=$value ;;
    --max-restarts) max_restarts=$value ;;
  esac
done

[ -n "$name" ] || usage_error "--name is required"
# Pod names add '-slice-<job>-<pod>-<suffix>' to it and must stay within 63 characters.
[[ "$name" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ && ${#name} -le 40 ]] ||
  usage_error "--name '$name' must be lowercase letters, digits and '-', start with a letter, at most 40 characters"
[ -n "$accelerator" ] || usage_error "--accelerator is required (one of: $ACCELERATORS)"
[[ " $ACCELERATORS " == *" $accelerator "* ]] ||
  usage_error "--accelerator '$accelerator' is not one of: $ACCELERATORS"
[ -n "$topology" ] || usage_error "--topology is required"
case "$accelerator" in
  tpu-v4-podslice | tpu-v5p-slice)
    [[ "$topology" =~ ^[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*$ ]] ||
      usage_error "--topology '$topology' must be AxBxC (e.g. 4x4x4) for $accelerator"
    ;;
  *)
    [[ "$topology" =~ ^[1-9][0-9]*x[1-9][0-9]*$ ]] ||
      usage_error "--topology '$topology' must be AxB (e.g. 16x16) for $accelerator"
    ;;
esac
[ -n "$image" ] || usage_error "--image is required"
[[ "$image" =~ ^[A-Za-z0-9][A-Za-z0-9._/:@-]*$ ]] || usage_error "--image '$image' is not an image reference"
[ -n "$workdir" ] || usage_error "--workdir is required"
[[ "$workdir" =~ ^gs://[^/]+ ]] ||
  usage_error "--workdir '$workdir' must be a gs:// path: every Pod writes and resumes from it"
[[ "$slices" =~ ^[1-9][0-9]*$ ]] || usage_error "--slices '$slices' must be a positive integer"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || usage_error "--max-restarts '$max_restarts' must be an integer >= 0"
if [ -n "$steps" ] && ! [[ "$steps" =~ ^[1-9][0-9]*$ ]]; then
  usage_error "--steps '$steps' must be a positive integer"
fi
for a in "$config" "$workdir" "${overrides[@]+"${overrides[@]}"}"; do
  [[ "$a" != *[[:cntrl:]]* ]] || usage_error "control characters are not allowed in '$a'"
done

# Chips per TPU VM: multi-host slices of these accelerators have 4 chips per VM; the single-host
# v5e/v6e 2x4 slice has 8 on one VM; smaller slices are one VM with all their chips.
chips=1
IFS=x read -r -a dims <<<"$topology"
for d in "${dims[@]}"; do
  chips=$((chips * d))
done
if [ "$chips" -le 4 ] || { [ "${#dims[@]}" = 2 ] && [ "$chips" = 8 ]; }; then
  chips_per_vm=$chips
else
  chips_per_vm=4
fi
vms_per_slice=$((chips / chips_per_vm))
if [ "$slices" -gt 1 ] && [ "$vms_per_slice" = 1 ]; then
  usage_error "--topology $topology is a single-host slice; multi-slice (--slices $slices) needs multi-host slices"
fi

# --------------------------------------------------------------------------------------------
# The config against the slices, here, before anything is submitted

case "$accelerator" in
  tpu-v4-podslice) kind=v4 ;;
  tpu-v5-lite-podslice) kind=v5e ;;
  tpu-v5p-slice) kind=v5p ;;
  tpu-v6e-slice) kind=v6e ;;
esac
# shellcheck source=launch/slice_check.sh
source "$HERE/../slice_check.sh"
check_args=(--config "$config" --topology "$kind:$topology" --slices "$slices")
[ -z "$steps" ] || check_args+=("--config.steps=$steps")
check_args+=("${overrides[@]+"${overrides[@]}"}")
slice_check "$PROG" "$preflight" "${check_args[@]}"

# --------------------------------------------------------------------------------------------
# Render

train=(jaxmoe train --config "$config" --workdir "$workdir")
[ -z "$steps" ] || train+=("--config.steps=$steps")
train+=("${overrides[@]+"${overrides[@]}"}")
command_yaml="["
for a in "${train[@]}"; do
  command_yaml+="$(yaml_string "$a"), "
done
command_yaml="${command_yaml%, }]"

# Literal replacements: with patsub_replacement (bash >= 5.2) '&' in a replacement would mean
# the matched text.
shopt -u patsub_replacement 2>/dev/null || true
manifest=$(<"$TEMPLATE")
while read -r p; do
  case "$p" in
    __NAME__ | __MAX_RESTARTS__ | __SLICES__ | __VMS_PER_SLICE__ | __ACCELERATOR__ | __TOPOLOGY__ | \
      __IMAGE__ | __COMMAND__ | __CHIPS_PER_VM__) ;;
    *) echo "$PROG: internal error: $TEMPLATE has a placeholder this script does not fill: $p" >&2 && exit 1 ;;
  esac
done < <(grep -o '__[A-Z_]*__' "$TEMPLATE" | sort -u)
manifest=${manifest//__NAME__/$name}
manifest=${manifest//__MAX_RESTARTS__/$max_restarts}
manifest=${manifest//__SLICES__/$slices}
manifest=${manifest//__VMS_PER_SLICE__/$vms_per_slice}
manifest=${manifest//__ACCELERATOR__/$accelerator}
manifest=${manifest//__TOPOLOGY__/$(yaml_string "$topology")}
manifest=${manifest//__IMAGE__/$image}
manifest=${manifest//__COMMAND__/$command_yaml}
manifest=${manifest//__CHIPS_PER_VM__/$chips_per_vm}

if [ "$dry_run" = 1 ]; then
  echo "+ kubectl apply -f -"
  printf '%s\n' "$manifest"
  exit 0
fi

command -v kubectl >/dev/null || { echo "$PROG: kubectl not found on PATH" >&2; exit 1; }
echo "+ kubectl apply -f -" >&2
printf '%s\n' "$manifest" | kubectl apply -f -
cat >&2 <<EOF
$PROG: submitted JobSet $name: $slices x $accelerator $topology ($vms_per_slice VMs x $chips_per_vm chips per slice).
  kubectl get jobset $name
  kubectl get pods -l jobset.sigs.k8s.io/jobset-name=$name
  kubectl logs -f -l jobset.sigs.k8s.io/jobset-name=$name --max-log-requests=$((slices * vms_per_slice)) --prefix
  kubectl delete jobset $name
EOF
