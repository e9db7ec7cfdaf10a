#!/usr/bin/env bash
# Tree shapes on one drafter (issue 33, goal 2: tree tau >= 4.5): `eyas bench --tree` on held-out ShareGPT for each
# TOP_K:DEPTH:TOTAL shape, with the plain and prompt-lookup baselines of each process, and one markdown row per shape.
# The preset's tree is 10:6:60. A deeper tree than the drafter's TTT steps drafts past what it was trained on.
#   bash benchmarks/tree_shapes.sh DRAFTER [TARGET]      (DRAFTER: an eyas run, export or train/drafter directory)
#   SHAPES='10:6:60 10:8:100' LIMIT=30 COMPILE=1 MD=/root/after.md  (defaults below; COMPILE=1 adds --compile)
set -u
D=${1:?usage: tree_shapes.sh DRAFTER [TARGET]}
T=${2:-smollm2-135m}
MD=${MD:-/root/after.md}
LIMIT=${LIMIT:-30}
SHAPES=${SHAPES:-10:6:60 10:8:60 10:8:100 8:10:80 16:8:128}
tmp=$(mktemp -d)
{
  echo "## Tree shapes on one drafter (issue 33) — $(date -u '+%Y-%m-%d %H:%M') UTC"
  echo "- machine: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); drafter $D; target $T"
  echo "- each row: \`eyas bench --drafter $D --target $T --prompts sharegpt-heldout --tree --top-k K --depth D"
  echo "  --total-tokens N --limit $LIMIT --max-turns 1 --max-new-tokens 128 --dtype bf16$([ -n "${COMPILE:-}" ] && echo ' --compile')\`"
  echo ""
  echo "| top_k:depth:total | tree tau (95% interval) | tree tok/s | plain tok/s | lookup tau | tree vs plain | acceptance by depth |"
  echo "|---|---|---|---|---|---|---|"
} >> "$MD"
for s in $SHAPES; do
  IFS=: read -r k d n <<< "$s"
  echo "== $(date -u +%H:%M:%S) shape $s"
  timeout 300 python3 -m eyas bench --drafter "$D" --target "$T" --prompts sharegpt-heldout --tree --top-k "$k" \
    --depth "$d" --total-tokens "$n" --limit "$LIMIT" --max-turns 1 --max-new-tokens 128 --dtype bf16 \
    ${COMPILE:+--compile} --json "$tmp/$s.json" || { echo "!! exit $? on shape $s"; echo "| $s | failed | | | | | |" >> "$MD"; continue; }
  python3 - "$tmp/$s.json" "$s" >> "$MD" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1])); m = r["methods"]
t, p, lk = m["eagle-tree"], m["plain"], m.get("lookup", {})
ci = t.get("tau_ci95") or [0, 0]
acc = " ".join(f"{a:.2f}" for a in t["acceptance_by_position"])
print(f"| {sys.argv[2]} | {t['tau']:.2f} ({ci[0]:.2f}-{ci[1]:.2f}) | {t['tokens_per_s']} | {p['tokens_per_s']} | "
      f"{lk.get('tau', float('nan')):.2f} | {t.get('speedup', 0)}x | {acc} |")
EOF
done
echo "" >> "$MD"
rm -rf "$tmp"
