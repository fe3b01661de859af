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
# The default run's bar (README): held-out loss below 3.5 nats by its end (chance: ln 512 = 6.24).
python - "$WORKDIR/metrics.jsonl" <<'PY'
import json, math, sys
held = [(r["step"], r["heldout_loss"]) for r in map(json.loads, open(sys.argv[1])) if "heldout_loss" in r]
step, loss = held[-1]
verdict = "below" if loss < 3.5 else "not yet below"
print(f"== held-out loss {loss:.3f} at step {step}: {verdict} the 3.5 threshold (chance: ln 512 = {math.log(512):.2f})")
PY
echo "== jaxmoe generate --checkpoint $WORKDIR --prompt 'def '"
jaxmoe generate --checkpoint "$WORKDIR" --prompt "def " --max-new-tokens 48
