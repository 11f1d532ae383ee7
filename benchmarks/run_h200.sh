#!/usr/bin/env bash
# The GPU benchmark runs behind benchmarks/results/ and docs/benchmarks.md, in stages.
#   bash benchmarks/run_h200.sh smoke|offline|widened|dp|serve OUT_DIR
# Needs .bench/codepair (a copy of ../shared/models/codepair) and .bench/{hf_baselines,widen}.py
# (copies of ../shared/bench/); with no package index there, pydantic etc. come as wheels in .whl/.
set -uo pipefail
stage=$1; out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ! python3 -c "import pydantic, fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
P=.bench/codepair
case "$stage" in
smoke)
  nvidia-smi -L
  python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__, torch.cuda.device_count())"
  head -8 $P/heldout_prompts.jsonl > "$out/p8.jsonl"
  python3 -m specdp_cli validate config benchmarks/codepair.yaml --dp 2
  python3 -m specdp_cli generate benchmarks/codepair.yaml --input "$out/p8.jsonl" --output "$out/o1.jsonl" --summary-json "$out/smoke_dp1.json"
  python3 -m specdp_cli generate benchmarks/codepair.yaml --input "$out/p8.jsonl" --output "$out/o2.jsonl" --dp 2 \
    --set parallel.dp_sync=always --set parallel.check_collectives=true --summary-json "$out/smoke_dp2.json"
  python3 - "$out" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1] + "/o1.jsonl")]; b = [json.loads(l) for l in open(sys.argv[1] + "/o2.jsonl")]
print("dp1 vs dp2 lockstep, bf16 greedy token_ids equal:", sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b)), "/", len(a))
PY
  SPECDP_FAULT=single-dummy-forward:1 timeout 120 python3 -m specdp_cli generate benchmarks/codepair.yaml --input "$out/p8.jsonl" \
    --output "$out/o3.jsonl" --dp 2 --set parallel.dp_sync=always --set parallel.collective_timeout_s=60; echo "fault run exit: $?"
  ;;
offline)
  CUDA_VISIBLE_DEVICES=1 python3 .bench/hf_baselines.py $P --prompts 32 --new 128 > "$out/hf_codepair.jsonl" 2> "$out/hf_codepair.err" &
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --json "$out/offline_codepair.json" > "$out/offline_codepair.log" 2>&1
  wait
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/hf_rows.py .bench/hf_baselines.py $P --cases static:32 >> "$out/hf_codepair.jsonl" 2>> "$out/hf_codepair.err"
  tail -12 "$out/offline_codepair.log"; cat "$out/hf_codepair.jsonl"
  ;;
offline-quick)
  # the specdp table plus the HF rows its targets compare with (batch 1, assisted k = 4, static batch 32)
  CUDA_VISIBLE_DEVICES=1 python3 benchmarks/hf_rows.py .bench/hf_baselines.py $P --cases generate_bs1,assisted_k4,static:32 \
    > "$out/hf_codepair_quick.jsonl" 2> "$out/hf_codepair_quick.err" &
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --json "$out/offline_codepair_v2.json" > "$out/offline_codepair_v2.log" 2>&1
  wait
  tail -10 "$out/offline_codepair_v2.log"; cat "$out/hf_codepair_quick.jsonl"
  ;;
widened)
  python3 .bench/widen.py $P/target /tmp/wide/target > "$out/widen.log" 2>&1 || { cat "$out/widen.log"; exit 1; }
  mkdir -p /tmp/wide && ln -sfn "$PWD/$P/draft" /tmp/wide/draft && ln -sfn "$PWD/$P/tokenizer" /tmp/wide/tokenizer \
    && cp $P/heldout_prompts.jsonl /tmp/wide/
  CUDA_VISIBLE_DEVICES=1 python3 .bench/hf_baselines.py /tmp/wide --prompts 16 --new 128 > "$out/hf_widened.jsonl" 2> "$out/hf_widened.err" &
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --target /tmp/wide/target --prompts 16 --batches 1,16 \
    --methods none,draft_model --label widened --json "$out/offline_widened.json" > "$out/offline_widened.log" 2>&1
  wait
  tail -6 "$out/offline_widened.log"; cat "$out/hf_widened.jsonl"
  ;;
dp)
  python3 benchmarks/dp_scaling.py --pair $P --dps "${DPS:-1,2}" --cuts "${CUTS:-16}" --work /tmp/dpwork --json "$out/dp_scaling.json" 2>&1 | tail -8
  ;;
serve)
  python3 benchmarks/serve_bench.py --pair $P --work /tmp/servework --json "$out/serve.json" 2>&1 | tail -8
  cp /tmp/servework/server.log "$out/" 2>/dev/null
  ;;
esac
