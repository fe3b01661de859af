#!/usr/bin/env bash
# The main job on its embedded default, on a fresh clone (only Python 3.11 + pip needed): makes
# .venv, installs jaxmoe, trains the tiny hybrid model (mla, kda, dsa + MoE) on XLA's 8-device CPU
# mesh (data 2 x expert 2 x context 2, configs/tiny.py:train) on the Python standard library's own
# sources, saves Orbax checkpoints and an MXFP4 export, then prints a sample.
#
#   bash launch/local.sh                               # 300 steps, a few minutes, into runs/tiny
#   bash launch/local.sh --config.steps=20             # any --config.KEY=VALUE override
#   JAXMOE_WORKDIR=/tmp/run bash launch/local.sh       # another run directory
#
# Running it again resumes from the run directory's last checkpoint.
source "$(dirname "$0")/env.sh"
WORKDIR="${JAXMOE_WORKDIR:-runs/tiny}"
echo "== jaxmoe train --config configs/tiny.py:train --workdir $WORKDIR $*"
jaxmoe train --config configs/tiny.py:train --workdir "$WORKDIR" "$@"
echo "== jaxmoe generate --checkpoint $WORKDIR --prompt 'def '"
jaxmoe generate --checkpoint "$WORKDIR" --prompt "def " --max-new-tokens 48
