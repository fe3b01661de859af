#!/usr/bin/env bash
# The main job on its embedded default, on a fresh clone (only Python 3.11 + pip needed):
# sizes of the 2.8T target model, then the tiny hybrid model's forward pass sharded over an
# 8-device CPU mesh (data 2 x fsdp 2 x tensor 2). Until the training job lands, this is the job.
source "$(dirname "$0")/env.sh"
echo "== jaxmoe info --config configs/target.py"
jaxmoe info --config configs/target.py
echo "== tiny model forward on the 8-device CPU mesh"
python launch/tiny_forward.py --config configs/tiny.py
