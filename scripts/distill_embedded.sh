#!/usr/bin/env bash
# Reproduces the embedded default drafter (OUT/l4, shipped in fetch/assets/) and the depth sweep
# (OUT/l1, OUT/l2) reported in docs/distill.md. Usage: scripts/distill_embedded.sh OUT [DEVICE]
# On one H100 the three runs take about 12 minutes (most of it the target writing 7680 answers);
# on a 2-core CPU the same settings take the better part of a day.
set -euo pipefail
out=${1:?usage: scripts/distill_embedded.sh OUT [DEVICE]}
device=${2:-auto}
hybridspec=${HYBRIDSPEC:-hybridspec}
target=${TARGET:-$($hybridspec models pull --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["target"])')}
common=(--target "$target" --steps 3000 --batch-tokens 16384 --lr 2e-3 --eval-every 250 --heldout 48
        --head-size 8192 --seed 0 --device "$device" --base embedded:target)
$hybridspec distill "${common[@]}" --out "$out/l4" --layers 4 --store int8 \
  --generate 7680 --max-new-tokens 160 --gen-batch-size 256
for layers in 1 2; do
  $hybridspec distill "${common[@]}" --out "$out/l$layers" --layers "$layers" --data "$out/l4/train-samples.jsonl"
done
