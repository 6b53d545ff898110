#!/bin/bash
# Launch a recipe with DeepSpeed's launcher; options are dstrain.launcher's:
#
#   launch/deepspeed.sh --nproc 2 RECIPE.json [--key=value ...]
#   launch/deepspeed.sh --hostfile launch/hostfile.example RECIPE.json
#   launch/deepspeed.sh --print --nproc 2 RECIPE.json     # show the command only
#
# Set PYTHON to pick the interpreter (its bin/deepspeed is used).
set -euo pipefail
exec "${PYTHON:-python}" -m dstrain.launcher --backend deepspeed "$@"
