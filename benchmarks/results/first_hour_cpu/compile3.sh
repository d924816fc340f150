#!/bin/bash
# eager, then --compile with an empty inductor cache, then again with it filled: offline default, 8 new tokens
export PYTHONPATH=/work/main HOME=/tmp/fh/home1 HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=/tmp/fh/inductor3
rm -rf /tmp/fh/inductor3
P="Write a haiku about the sea."
for run in eager compile-cold compile-warm eager; do
  flags=""; [[ $run == compile* ]] && flags="--compile"
  echo "== $run $(uptime | sed 's/.*load/load/')" >> compile3.txt
  python /tmp/fh/phases_real.py generate $flags --max-new-tokens 8 "$P" 2>&1 >/dev/null | grep -E "^\[|note|batch size" >> compile3.txt
done
