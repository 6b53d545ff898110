#!/bin/bash
# Launch a recipe with torchrun (torch.distributed.run):
#
#   launch/torchrun.sh --nproc 2 RECIPE.json [--key=value ...]
#   # multi-node: run on every node
#   launch/torchrun.sh --nproc 8 --num-nodes 2 --master-addr node0 --local-addr THIS_NODE RECIPE.json
#   launch/torchrun.sh --print --nproc 2 RECIPE.json      # show the command only
set -euo pipefail
exec "${PYTHON:-python}" -m dstrain.launcher --backend torchrun "$@"
