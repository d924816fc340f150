#!/usr/bin/env bash
# CPU speed of the offline default pair before and after a refactor (issue #31), in one session: the same
# `specdec bench` (target alone and speculative, batch sizes 1 and 8) run by the OLD tree, then by the NEW
# one (this checkout). A smaller version of benchmarks/results/bench_batch_cpu's command (16 prompts,
# 64 new tokens there): 8 prompts and 48 new tokens, about 6 minutes for both on 2 busy cores.
#
#   benchmarks/before_after_speed.sh OLD_TREE SPEC_BENCH_JSONL [OUT_DIR]
#   e.g. benchmarks/before_after_speed.sh /work/wt-before /work/shared/data/prompts/spec_bench_question.jsonl
#
# OLD_TREE: a checkout of the code before the refactor (e.g. `git worktree add ../wt-before 675b6ee --detach`).
# SPEC_BENCH_JSONL: Spec-Bench's question.jsonl. OUT_DIR: default benchmarks/results/refactor_speed_cpu;
# results go to OUT_DIR/before and OUT_DIR/after, each with command.txt (what ran, on which tree, versions,
# CPU) and stdout.txt (bench's table). LIMIT, MAX_NEW_TOKENS, BATCH_SIZES and THREADS in the environment
# change the settings; NEW_TREE runs another tree than this checkout as the new one. A folder that already
# holds results is refused (bench would resume it and run nothing): delete it, or give another OUT_DIR.
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
[ -d "$1" ] || { echo "error: old tree '$1' is not a folder" >&2; exit 2; }
[ -f "$2" ] || { echo "error: dataset '$2' not found" >&2; exit 2; }
OLD=$(realpath "$1")
DATASET=$(realpath "$2")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NEW=$(realpath "${NEW_TREE:-$HERE}")
OUT=$(realpath -m "${3:-$HERE/benchmarks/results/refactor_speed_cpu}")
LIMIT=${LIMIT:-8}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-48}
BATCH_SIZES=${BATCH_SIZES:-1,8}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-python}

for tree in "$OLD" "$NEW"; do
    [ -d "$tree/specdec_cli" ] || { echo "error: $tree has no specdec_cli/ (give a checkout of the project)" >&2; exit 2; }
done
[ "$OLD" != "$NEW" ] || { echo "error: the old tree is this checkout; give the tree from before the refactor" >&2; exit 2; }
for name in before after; do
    if [ -e "$OUT/$name/samples.jsonl" ] || [ -e "$OUT/$name/config.json" ]; then
        echo "error: $OUT/$name already holds results; delete it or give another OUT_DIR" >&2
        exit 2
    fi
done

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

describe_tree() {  # the commit of a tree, and whether its specdec code has uncommitted changes
    local rev dirty
    rev=$(git -C "$1" rev-parse HEAD 2>/dev/null || echo "not a git checkout")
    dirty=$(git -C "$1" status --porcelain -- specdec_cli specdec_plugins 2>/dev/null | wc -l)
    echo "$rev$([ "$dirty" -gt 0 ] && echo " (+ $dirty uncommitted changes in specdec_cli/specdec_plugins)")"
}

in_tree() {  # in_tree TREE COMMAND...: run with TREE's code. Not from a checkout's root: python puts the current
    # folder (-m, -c) before PYTHONPATH on sys.path, so this checkout's specdec_cli would win over TREE's.
    local tree=$1
    shift
    (cd "$OUT" && PYTHONPATH=$tree "$@")
}

bench() {  # bench NAME TREE
    local name=$1 tree=$2 folder=$OUT/$1 start end found
    local -a command=("$PYTHON" -m specdec_cli bench --task spec-bench --dataset "$DATASET" --shuffle
                      --limit "$LIMIT" --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$BATCH_SIZES"
                      --threads "$THREADS" --device cpu --output "$folder")
    mkdir -p "$folder"
    found=$(in_tree "$tree" "$PYTHON" -c 'import os, specdec_cli; print(os.path.dirname(os.path.realpath(specdec_cli.__file__)))')
    if [ "$found" != "$(realpath "$tree/specdec_cli")" ]; then
        echo "error: with PYTHONPATH=$tree, python imports specdec_cli from $found" >&2
        exit 1
    fi
    {
        echo "# $name: $(date -u +%FT%TZ)"
        echo "tree: $tree"
        echo "commit: $(describe_tree "$tree")"
        echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') ($(nproc) cores visible)"
        echo "versions: $(in_tree "$tree" "$PYTHON" -c 'import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__)'), specdec_cli from $found"
        echo "load (1, 5, 15 min): $(cut -d' ' -f1-3 /proc/loadavg)"
        echo
        echo "(cd $OUT && PYTHONPATH=$tree ${command[*]})"
    } > "$folder/command.txt"
    echo ">>> $name ($tree)"
    start=$(date +%s)
    in_tree "$tree" "${command[@]}" 2>&1 | tee "$folder/stdout.txt"
    end=$(date +%s)
    echo "wall time: $((end - start)) s" >> "$folder/command.txt"
    echo ">>> $name: $((end - start)) s"
}

# The default recipe's GGUF is converted once (cached under SPECDEC_CACHE, default ~/.cache/specdec):
# convert it here, untimed, so neither measured run pays it.
echo ">>> warm-up: the default pair loaded once (converts the GGUF if it is not cached yet)"
mkdir -p "$OUT"
in_tree "$NEW" "$PYTHON" -m specdec_cli generate --device cpu --max-new-tokens 2 --threads "$THREADS" "Hi" > /dev/null

bench before "$OLD"
bench after "$NEW"

cat <<EOF

Both runs are in $OUT. Tables again:
    (cd $OUT && PYTHONPATH=$NEW $PYTHON -m specdec_cli bench --report before)
    (cd $OUT && PYTHONPATH=$NEW $PYTHON -m specdec_cli bench --report after)
Samples (tokens) of the two runs should be identical: compare token_ids in before/samples.jsonl and after/samples.jsonl.
EOF
