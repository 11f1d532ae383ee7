#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/ and docs/benchmarks.md, in stages (2 GPUs: specdp on GPU 0,
# the Hugging Face rows of the same run on GPU 1 at the same time):
#   bash benchmarks/run_h200.sh all|gpu-tests|codepair|widened|memory|dp|serve|adaptive|adaptive-8b-small|recheck|final|refactor|moe|fp8|prefix|gemv|batch1|s21|s22|s24|s25|s25b|s25c|s25d|s26|s26b|s27|s27b|s27c|s28|s29|s29b|s29c|s30serve|s30core|s31contention|s31threads|s31serve|s33link|s35loop|s36|s37|s38|s39|s40|s41|s41cpu|s42 OUT_DIR
#   (s31contention with KINDS=spin,frontend OTHERS=0,4: the offline engine beside a real serving load, session 32)
# Needs .bench/codepair: the codepair pair (`python3 benchmarks/train_pair.py .bench/codepair` trains one; the runs
# here used the project's shared copy); with no package index there, pydantic etc. come as wheels in .whl/.
set -uo pipefail
stage=$1; out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the image ships no bytecode and sets PYTHONDONTWRITEBYTECODE: every process would compile every module it
# imports (seconds of start-up no pip-installed machine pays); cache it as an installed package would have it
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
if [ -d .whl ] && ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
P=.bench/codepair
W=/tmp/wide
widen() {   # the 8B-shaped target that computes the codepair target's function (benchmarks/widen.py)
  [ -f $W/target/config.json ] && return 0
  python3 benchmarks/widen.py $P/target $W/target > /tmp/widen.log 2>&1 || { cat /tmp/widen.log; return 1; }
  ln -sfn "$PWD/$P/draft" $W/draft && ln -sfn "$PWD/$P/tokenizer" $W/tokenizer && cp $P/heldout_prompts.jsonl $W/
}
# a stage's time box: it sets end=$((SECONDS + LIMIT)); each step gets what is left (at least 5 s)
left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
ak() {   # GPU NAME ARGS...: one benchmarks/adaptive_k.py run within the time box, JSON and log in OUT
  gpu=$1; name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout $(left) python3 benchmarks/adaptive_k.py --pair $P "$@" --json "$out/$name.json" \
    > "$out/$name.log" 2>&1
}
offline() {   # NAME ARGS...: one benchmarks/offline.py run on GPU 0, JSON in OUT, log in /tmp
  name=$1; shift
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/offline.py "$@" --json "$out/$name.json" > /tmp/$name.log 2>&1 \
    || { echo "== $name failed"; tail -20 /tmp/$name.log; }
}
measured_round_begun() {   # a serve_bench.py run's measured round has begun: the rank has generated more than
  # the warm-up's 32 x 128 tokens (its /metrics)
  python3 - <<'PY'
import time, urllib.request
for _ in range(300):
    try:
        text = urllib.request.urlopen("http://127.0.0.1:8321/metrics", timeout=2).read().decode()
        if sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith("specdp:generation_tokens_total")) > 8000:
            break
    except OSError:
        pass
    time.sleep(0.2)
PY
}
case "$stage" in
all)
  # everything in one lease: GPU 1 runs the Hugging Face rows (and builds the 8B-shaped target)
  # while GPU 0 runs the GPU tests and specdp's benchmarks; DP scaling (both GPUs) comes last
  ( export CUDA_VISIBLE_DEVICES=1
    python3 benchmarks/hf_rows.py $P --cases generate_bs1,static:32
    python3 benchmarks/graph_floor.py $P/target --bs 1,32 --label _codepair
    widen && touch /tmp/widened
    python3 benchmarks/hf_rows.py $W --prompts 16 --cases generate_bs1,static:16
    python3 benchmarks/graph_floor.py $W/target --bs 1,16 --label _8b ) > "$out/hf.jsonl" 2> /tmp/hf.err &
  hf=$!
  if [ "${GPU_TESTS:-1}" = 1 ]; then      # GPU_TESTS=0: the adaptive stage runs them instead
    timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
    tail -3 "$out/gpu_tests.log"
  fi
  m=none,ngram,draft_model; [ -d $P/eagle ] && m=$m,eagle; [ -d $P/eagle3 ] && m=$m,eagle3
  offline offline_codepair_bs1 --pair $P --batches 1,32 --methods $m
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/step_probe.py --pair $P --methods none,draft_model,eagle \
    --json "$out/step_probe.json" > /tmp/step_probe.log 2>&1 || tail -5 /tmp/step_probe.log
  offline offline_codepair_256 --pair $P --requests 256 --batches 32 --methods $m
  offline offline_codepair_eager --pair $P --batches 32 --methods none,draft_model --eager
  for i in $(seq 120); do [ -f /tmp/widened ] && break; sleep 2; done
  offline offline_widened --pair $P --target $W/target --prompts 16 --batches 1,16 --methods none,draft_model --label widened
  offline offline_memory --pair $P --target $W/target --requests 256 --batches 256 --methods none --max-model-len 4096 \
    --label widened-memory
  for i in $(seq 60); do kill -0 $hf 2>/dev/null || break; sleep 2; done
  for dm in ${DP_METHODS:-draft_model}; do     # DP scaling per method (both GPUs)
    timeout ${DP_TIMEOUT:-170} python3 benchmarks/dp_scaling.py --pair $P --method $dm \
      --runs "${RUNS:-1:never,1:never,2:never,2:never,2:always}" --work /tmp/dpwork-$dm \
      --json "$out/dp_scaling_$dm.json" > /tmp/dp-$dm.log 2>&1; grep -v "^{" /tmp/dp-$dm.log | tail -28
  done
  grep '"wall_ms_per_step"' /tmp/step_probe.log | cut -c1-400
  for f in offline_codepair_bs1 offline_codepair_256 offline_codepair_eager offline_widened offline_memory; do
    grep -A8 "^method" /tmp/$f.log; done
  cat "$out/hf.jsonl"
  ;;
adaptive-8b-small)
  # issue 14's 8B-shape rows at batch 1 and 4, too long for one call (one repeat of the eight rows at batch 1
  # is ~11 min): PART=1, 2, 3 split them over both GPUs and three back-to-back calls (the 8B shape is built
  # once per machine). The fixed k <= 3 rows run on GPU 0, k >= 4 and adaptive on GPU 1; k = 0 at batch 1
  # (~160 s a run, 2.5 x slower than any k >= 2) runs once. Pool the parts with plot_adaptive.py.
  export CUDA_VISIBLE_DEVICES=1; widen || exit 1; unset CUDA_VISIBLE_DEVICES
  ak() { gpu=$1; name=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-500} python3 benchmarks/adaptive_k.py --pair $P --target $W/target \
      --label 8b-shape "$@" --json "$out/$name.json" > "$out/$name.log" 2>&1; }
  case "${PART:-1}" in
    1) ak 0 ak8_bs1_k123_a --batches 1 --ks 1,2,3 --no-adaptive --repeats 2 &
       ak 1 ak8_bs1_k456_a --batches 1 --ks 4,5,6 --repeats 2 ;;
    2) ( ak 0 ak8_bs1_k123_b --batches 1 --ks 1,2,3 --no-adaptive --repeats 1
         ak 0 ak8_bs1_k0 --batches 1 --ks 0 --no-adaptive --repeats 1 ) &
       ak 1 ak8_bs1_k456_b --batches 1 --ks 4,5,6 --repeats 1 ;;
    3) ak 0 ak8_bs4_k0123 --batches 4 --ks 0,1,2,3 --no-adaptive --repeats 3 &
       ak 1 ak8_bs4_k456 --batches 4 --ks 4,5,6 --repeats 3 ;;
  esac
  wait
  if [ "${PART:-1}" = 3 ]; then      # then issue 14's lockstep check: adaptive vs fixed k = 4 on 2 GPUs
    timeout 110 python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-adaptive \
      --runs 2:always,2:always:adaptive,2:always,2:always:adaptive,2:always,2:always:adaptive \
      --json "$out/dp_adaptive.json" > /tmp/dp-adaptive.log 2>&1; grep -A3 "^medians" /tmp/dp-adaptive.log
  fi
  tail -n 4 "$out"/ak8_*.log
  ;;
adaptive)
  # issue 14's table: adaptive vs every fixed k per batch size, one process per model (adaptive_k.py). GPU 0:
  # the codepair at CP_BATCHES (empty: none); GPU 1: the GPU tests first when GPU_TESTS=1 (the 2-GPU one
  # after everything), then the 8B shape at B8_BATCHES (a 10-minute call holds only a few of its batch
  # sizes); LOCKSTEP=1 then compares adaptive with fixed k = 4 on 2 GPUs in lockstep (dp_scaling.py).
  # Every step gets what is left of LIMIT seconds, and the JSON is rewritten after each batch size.
  end=$((SECONDS + ${LIMIT:-570}))
  if [ -n "${CP_BATCHES-1,4,16,32,64}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 benchmarks/adaptive_k.py --pair $P --batches "${CP_BATCHES-1,4,16,32,64}" \
      --requests "${REQUESTS:-256}" --json "$out/adaptive_codepair.json" > "$out/adaptive_codepair.log" 2>&1 &
  fi
  ( export CUDA_VISIBLE_DEVICES=1
    if [ "${GPU_TESTS:-0}" = 1 ]; then
      timeout $(left) python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "not nccl" \
        > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
    fi
    if [ -n "${B8_BATCHES:-}" ]; then
      widen || exit 1
      timeout $(left) python3 benchmarks/adaptive_k.py --pair $P --target $W/target --label 8b-shape \
        --batches "$B8_BATCHES" --requests "${REQUESTS:-256}" --json "$out/adaptive_8b.json" > "$out/adaptive_8b.log" 2>&1
    fi )
  wait
  if [ "${GPU_TESTS:-0}" = 1 ]; then
    timeout $(left) python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k nccl >> "$out/gpu_tests.log" 2>&1
    tail -3 "$out/gpu_tests.log"
  fi
  if [ "${LOCKSTEP:-0}" = 1 ]; then
    timeout $(left) python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-adaptive \
      --runs 2:always,2:always:adaptive,2:always,2:always:adaptive,2:always,2:always:adaptive \
      --json "$out/dp_adaptive.json" > /tmp/dp-adaptive.log 2>&1; grep -v "^{" /tmp/dp-adaptive.log | tail -20
  fi
  tail -n 8 "$out"/adaptive_*.log 2>/dev/null
  ;;
gpu-tests)
  nvidia-smi -L
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider ${GPU_K:+-k "$GPU_K"} 2>&1 | tee "$out/gpu_tests.log" \
    | tail -25
  ;;
codepair)
  CUDA_VISIBLE_DEVICES=1 sh -c "python3 benchmarks/hf_rows.py $P --cases ${HF_CASES:-generate_bs1,static:32}; \
    python3 benchmarks/graph_floor.py $P/target --bs 1,32 --label _codepair" > "$out/hf_codepair.jsonl" 2> "$out/hf_codepair.err" &
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --batches 1 --profile "${PROFILE:-draft_model:1}" \
    --json "$out/offline_codepair_bs1.json" > "$out/offline_codepair_bs1.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --requests 256 --batches 32 \
    --json "$out/offline_codepair_256.json" > "$out/offline_codepair_256.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --batches 32 --methods none,draft_model --eager \
    --json "$out/offline_codepair_eager.json" > "$out/offline_codepair_eager.log" 2>&1
  wait
  grep -v "^{" "$out/offline_codepair_bs1.log" | head -90
  for f in bs1 256 eager; do grep -A8 "^method" "$out/offline_codepair_$f.log"; done
  cat "$out/hf_codepair.jsonl"
  ;;
widened)
  widen || exit 1
  CUDA_VISIBLE_DEVICES=1 sh -c "python3 benchmarks/hf_rows.py $W --prompts 16 --cases generate_bs1,static:16; \
    python3 benchmarks/graph_floor.py $W/target --bs 1,16 --label _8b" > "$out/hf_widened.jsonl" 2> "$out/hf_widened.err" &
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --target $W/target --prompts 16 --batches 1,16 \
    --methods none,draft_model --label widened --json "$out/offline_widened.json" > "$out/offline_widened.log" 2>&1
  wait
  grep -A8 "^method" "$out/offline_widened.log"; tail -3 "$out/offline_widened.log"; cat "$out/hf_widened.jsonl"
  ;;
memory)
  widen || exit 1
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/offline.py --pair $P --target $W/target --requests 256 --batches 256 \
    --methods none --max-model-len 4096 --label widened-memory --json "$out/offline_memory.json" > "$out/offline_memory.log" 2>&1
  tail -4 "$out/offline_memory.log"
  ;;
serve)
  # served vs offline (same config and prompts), then 1,500-token shared prefixes with caching on and off
  # (PART=1 / 2 / 3 run one part each: a call's time box; PROCS=2: two offline processes and two servers a method,
  # alternating; PREFIX_NEW=32: PART=2's 32-token run only; WORKERS=1,2: each count of load-generating
  # processes measured on the same server; PART=4: offline and served eagle (SPY_METHOD) under py-spy, needs its wheel in .whl;
  # PART=5: the CPU each process of served and offline eagle gets; PART=6: offline eagle beside busy cores)
  m=none,draft_model; [ -d $P/eagle ] && m=$m,eagle
  if [ "${PART:-1}" = 1 ]; then
    timeout ${SERVE_S:-540} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers ${WORKERS:-1} --work /tmp/sw1 \
      --processes ${PROCS:-1} --json "$out/serve_codepair.json" \
      2>&1 | tail -8
  fi
  if [ "${PART:-2}" = 2 ]; then      # 128 and 32 new tokens a request (decode-bound, prefill-bound)
    for n in ${PREFIX_NEW:-128 32}; do
      timeout 240 python3 benchmarks/serve_bench.py --pair $P --methods draft_model --prefix 1500 --caching on,off \
        --client-workers ${WORKERS:-1} --max-tokens $n --label prefix$n --work /tmp/sw2_$n --json "$out/serve_prefix_$n.json" 2>&1 | tail -5
    done
  fi
  if [ "${PART:-3}" = 3 ]; then
    widen && timeout 240 python3 benchmarks/serve_bench.py --pair $P --target $W/target --methods none,draft_model \
      --concurrency 16 --requests 64 --label 8b --work /tmp/sw3 --json "$out/serve_8b.json" 2>&1 | tail -4
  fi
  if [ "${PART:-}" = 4 ]; then       # where served and offline eagle's steps go: each side's rank sampled by py-spy for
    # 2 s of its measured run without pausing it (--nonblocking: waits for the device show as such), the GPU's SM clock
    # and utilization beside it (nvidia-smi every 100 ms); py-spy from .whl, summaries by benchmarks/pyspy_summary.py
    export PATH=/tmp/site/bin:$PATH
    sm=${SPY_METHOD:-eagle}      # the method profiled
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv,noheader -lms 100 \
      > /tmp/smi.csv 2>/dev/null &
    smi=$!
    spy() {   # NAME PID: 2 s of samples
      timeout 20 py-spy record --nonblocking --idle -r 250 -f raw -d 2 -p "$2" -o "$out/pyspy_$1.txt" > /tmp/spy_$1.log 2>&1 \
        || tail -3 /tmp/spy_$1.log
      echo "== $1: GPU over the window (SM MHz, util %)"; tail -n 20 /tmp/smi.csv | awk -F', ' '{c+=$2; u+=$4; n++} END {print c/n, u/n}'
    }
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/offline.py --pair $P --requests 256 --batches 32 --repeats 16 \
      --methods $sm --label offline-$sm --json "$out/offline_${sm}_x16.json" > /tmp/off4.log 2>&1 &
    ob=$!
    for i in $(seq 900); do grep -q "^# measuring" /tmp/off4.log && break; sleep 0.1; done
    spy offline_$sm "$(pgrep -n -f benchmarks/offline.py)"
    wait $ob; sed -n '/^method/,$p' /tmp/off4.log
    timeout 200 python3 benchmarks/serve_bench.py --pair $P --methods $sm --requests 2048 --rounds 1 --no-offline \
      --work /tmp/sw4 --json "$out/serve_${sm}_x8.json" > /tmp/sw4.log 2>&1 &
    sb=$!
    measured_round_begun
    spy served_$sm "$(pgrep -n -f specdp_cli.rank)"
    wait $sb; tail -1 /tmp/sw4.log
    kill $smi
    python3 -c "import json; r = json.load(open('$out/serve_${sm}_x8.json'))['rows'][0]; print('served', round(r['served_tok_s']), 'tok/s', round(r['served_ms_per_step'], 3), 'ms/step')"
    python3 benchmarks/pyspy_summary.py "$out/pyspy_offline_$sm.txt" --under "run (offline.py)" --top 22
    python3 benchmarks/pyspy_summary.py "$out/pyspy_served_$sm.txt" --under "serve_rank (" --top 22
  fi
  if [ "${PART:-}" = 5 ]; then       # the CPU of served eagle's processes (benchmarks/proc_cpu.py), then offline's;
    # PIN=1: the rank's threads on CPUs 8-15, the frontend and the client on 0-7
    nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|MHz"
    for pin in ${PINS:-0 1}; do
      pre=""; [ "$pin" = 1 ] && pre="taskset -c 0-7"
      timeout 200 $pre python3 benchmarks/serve_bench.py --pair $P --methods eagle --requests 2048 --rounds 1 --no-offline \
        --work /tmp/sw5_$pin --json "$out/serve_eagle_pin$pin.json" > /tmp/sw5.log 2>&1 &
      sb=$!
      if [ "$pin" = 1 ]; then
        for i in $(seq 300); do r=$(pgrep -n -f specdp_cli.rank) && break; sleep 0.2; done
        taskset -a -p -c 8-15 "$r" > /dev/null
      fi
      measured_round_begun
      python3 benchmarks/proc_cpu.py --seconds 2 --json "$out/proc_cpu_served_pin$pin.json"
      wait $sb; tail -1 /tmp/sw5.log
      python3 -c "import json; r = json.load(open('$out/serve_eagle_pin$pin.json'))['rows'][0]; print('served pin $pin', round(r['served_tok_s']), 'tok/s', round(r['served_ms_per_step'], 3), 'ms/step')"
    done
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/offline.py --pair $P --requests 256 --batches 32 --repeats 16 \
      --methods eagle --label offline-eagle --json "$out/offline_eagle_cpu.json" > /tmp/off5.log 2>&1 &
    ob=$!
    for i in $(seq 600); do grep -q "^# measuring" /tmp/off5.log && break; sleep 0.1; done
    python3 benchmarks/proc_cpu.py --seconds 2 --json "$out/proc_cpu_offline.json"
    wait $ob; sed -n '/^method/,$p' /tmp/off5.log
  fi
  if [ "${PART:-}" = 6 ]; then       # offline eagle with 0, 2 and 4 other processes busy on the CPU (Python loops, as a
    # frontend and a client are): does a host-bound step slow down when other cores work?
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/offline.py --pair $P --requests 256 --batches 32,32,32 --repeats 8 \
      --methods eagle --label offline-eagle-busy --json "$out/offline_eagle_busy.json" > /tmp/off6.log 2>&1 &
    ob=$!
    burn() { timeout 120 python3 -c "
import time
t = time.time()
while time.time() - t < 110:
    d = {i: str(i) for i in range(2000)}" & }
    for n in 1 2; do       # two more after each row (a row's JSON line)
      for i in $(seq 900); do [ "$(grep -c '^{' /tmp/off6.log)" -ge $n ] && break; sleep 0.1; done
      burn; burn
    done
    for i in $(seq 900); do [ "$(grep -c '^# measuring' /tmp/off6.log)" -ge 3 ] && break; sleep 0.1; done
    python3 benchmarks/proc_cpu.py --seconds 1 --top 6 | head -8
    wait $ob; pkill -f "d = {i: str" ; sed -n '/^method/,$p' /tmp/off6.log
  fi
  tail -3 /tmp/sw*/server_*.log > "$out/server_logs.txt" 2>/dev/null
  ;;
recheck)
  # after a change to the adaptive model or the rank's host loop, back-to-back calls (SPECDP_TRACE_K=1: the
  # adaptive runs' JSON carries every measured step). PART=1: the model's own host time per step
  # (adaptive_sim.py; before and after when .bench/spec_length_before.py holds the last version), issue 14's
  # lockstep check (adaptive vs fixed k = 4 on 2 GPUs, PAIRS=5 pairs), then adaptive vs fixed k on the codepair
  # at 4..64 on GPU 0 beside (GPU_TESTS=1) the GPU tests but the 2-GPU one and the 8B shape at 16 (k = 4..6:
  # the best k there) on GPU 1. PART=2: issue 9's DP pairs with their `always` runs, then the 8B shape at
  # batch 1 (adaptive and k = 6 on GPU 0, k = 5, 6 on GPU 1). PART=3: the 8B shape at 4, 32 and 64 (k = 4..6
  # and adaptive). PART=4: the codepair at batch 1 (every k and adaptive). Only the repository travels, and
  # at most 64 MiB of it with what `carry` names: with .bench/codepair's eagle heads (15 MB) it no longer
  # fits beside benchmarks/results: move them aside for these stages (they need only the target and draft).
  end=$((SECONDS + ${LIMIT:-560}))
  export SPECDP_TRACE_K=1
  case "${PART:-1}" in
  1)
    if [ -f .bench/spec_length_before.py ]; then     # the model's own host time per step, before and after
      python3 benchmarks/adaptive_sim.py --seeds 8 --spec-length .bench/spec_length_before.py | tail -8
      python3 benchmarks/adaptive_sim.py --seeds 8 | tail -8
    fi
    # PAIRS interleaved pairs (a run is ~20 s, mostly start-up; run to run the lockstep engine times
    # spread 10-20 %, so three pairs say little at the 5 % level)
    runs=$(for i in $(seq ${PAIRS:-5}); do printf "2:always,2:always:adaptive,"; done)
    timeout $((45 * ${PAIRS:-5})) python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-adaptive \
      --runs "${runs%,}" --json "$out/dp_adaptive.json" > "$out/dp_adaptive.log" 2>&1; grep -A3 "^medians" "$out/dp_adaptive.log"
    export CUDA_VISIBLE_DEVICES=1; widen || exit 1; unset CUDA_VISIBLE_DEVICES
    ak 0 adaptive_codepair --batches 4,16,32,64 --repeats 3 &
    if [ "${GPU_TESTS:-0}" = 1 ]; then    # the GPU tests but the 2-GPU one (the lockstep runs above cover NCCL)
      CUDA_VISIBLE_DEVICES=1 timeout $(left) python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
        -k "not nccl" > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
    fi
    ak 1 adaptive_8b --target $W/target --label 8b-shape --batches 16 --ks 4,5,6 --repeats 3 ;;
  2)
    for dm in none draft_model; do
      timeout 150 python3 benchmarks/dp_scaling.py --pair $P --method $dm --work /tmp/dpwork-$dm \
        --runs 1:never,2:never,1:never,2:never,1:never,2:never,2:always,2:always \
        --json "$out/dp_scaling_$dm.json" > "$out/dp_$dm.log" 2>&1; grep -A4 "^medians" "$out/dp_$dm.log"
    done
    export CUDA_VISIBLE_DEVICES=1; widen || exit 1; unset CUDA_VISIBLE_DEVICES
    # ~60 s a run: adaptive and k = 6 interleaved twice on GPU 0, k = 5 and 6 once more on GPU 1
    ak 0 ak8_bs1_adaptive --target $W/target --label 8b-shape --batches 1 --ks 6 --repeats 2 &
    ak 1 ak8_bs1_k56 --target $W/target --label 8b-shape --batches 1 --ks 5,6 --no-adaptive --repeats 1 ;;
  3)
    export CUDA_VISIBLE_DEVICES=1; widen || exit 1; unset CUDA_VISIBLE_DEVICES
    ak 0 ak8_bs4_32 --target $W/target --label 8b-shape --batches 4,32 --ks 4,5,6 --repeats 3 &
    ak 1 ak8_bs64 --target $W/target --label 8b-shape --batches 64 --ks 3,4,5,6 --repeats 3 ;;
  4)  # the codepair at batch 1 (every k and adaptive, ~10 s a run), alone on the machine: host-bound
    ak 0 adaptive_codepair_bs1 --batches 1 --repeats 3 ;;
  esac
  wait; tail -n 6 "$out"/*.log
  ;;
final)
  # issues 14 and 9, what is left, in back-to-back calls on one 2-GPU machine (session 10 ran parts 1-4).
  # PART=1: issue 14's table, the codepair at every batch size and every k (batch 1: 3 repeats, ~10 s a run;
  # 4..64: 5) on GPU 0; the 8B shape at batch 1, k = 6 and adaptive (~60 s a run) on GPU 1. PART=2: the 8B
  # shape's other rows (its best k are 5 and 6, at 32 and 64 also 3 and 4: the complete table of session 7).
  # PART=3: one-rank and two-rank start-up (dp_scaling.py, bytecode cached above, the first run reported),
  # issue 14's lockstep check (PAIRS=5 interleaved pairs; LOCKSTEP=0: not), then every GPU test. PART=4: the
  # codepair's rows without the 8B shape beside them, then the lockstep check. PART=5: the codepair's rows with
  # replayed schedules. Pool the parts with plot_adaptive.py.
  end=$((SECONDS + ${LIMIT:-570}))
  export SPECDP_TRACE_K=1
  a8() { gpu=$1; name=$2; shift 2; ak $gpu $name --target $W/target --label 8b-shape "$@"; }
  case "${PART:-1}" in 1|2|7|9) export CUDA_VISIBLE_DEVICES=1; widen || exit 1; unset CUDA_VISIBLE_DEVICES ;; esac
  case "${PART:-1}" in
  1) ( ak 0 table_codepair_bs1 --batches 1 --repeats 3
       ak 0 table_codepair --batches 4,16,32,64 --repeats 5 ) &
     a8 1 table_8b_bs1_k6 --batches 1 --ks 6 --repeats 3 ;;
  2) ( a8 0 table_8b_bs1_k5 --batches 1 --ks 5 --no-adaptive --repeats 3
       a8 0 table_8b_16_32 --batches 16,32 --ks 4,5,6 --repeats 3 ) &
     a8 1 table_8b_4_64 --batches 4,64 --ks 3,4,5,6 --repeats 3 ;;
  3) timeout 150 python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-startup \
       --runs 1:never,1:never,2:never,1:never,2:never,1:never,2:never --json "$out/startup.json" > "$out/startup.log" 2>&1
     grep -v "^{" "$out/startup.log" | tail -14
     if [ "${LOCKSTEP:-1}" = 1 ]; then
       runs=$(for i in $(seq ${PAIRS:-5}); do printf "2:always,2:always:adaptive,"; done)
       timeout $((45 * ${PAIRS:-5})) python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-adaptive \
         --runs "${runs%,}" --json "$out/dp_adaptive.json" > "$out/dp_adaptive.log" 2>&1; grep -A3 "^medians" "$out/dp_adaptive.log"
     fi
     timeout $(left) python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
     tail -3 "$out/gpu_tests.log" ;;
  4) # the codepair's rows again, alone on the machine (beside the 8B shape its runs spread 0.74-1.13 x pair by
     # pair), k = 0 left out (0.67-0.73 x the best at every batch size; at batch 1 also k = 1, 5, 6: <= 0.92),
     # batch 1 on GPU 1 (two host-bound processes, no 8B widening beside them), then the lockstep check
     ak 1 table_codepair_bs1_alone --batches 1 --ks 2,3,4 --repeats 3 &
     ak 0 table_codepair_alone --batches 4,16,32,64 --ks 1,2,3,4,5,6 --repeats 5
     wait
     runs=$(for i in $(seq ${PAIRS:-5}); do printf "2:always,2:always:adaptive,"; done)
     timeout $(left) python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-adaptive \
       --runs "${runs%,}" --json "$out/dp_adaptive.json" > "$out/dp_adaptive.log" 2>&1; grep -A3 "^medians" "$out/dp_adaptive.log" ;;
  5) # the codepair's table with a `replay` row after each adaptive run (adaptive_k.py --replay: the steps it
     # chose, forced, without the model): adaptive / replay is what choosing costs on the host, replay / best
     # fixed k what the chosen schedule is worth
     ak 1 table_codepair_bs1_replay --batches 1 --ks 2,3,4 --repeats 3 --replay &
     ak 0 table_codepair_replay --batches 4,16,32,64 --ks 1,2,3,4,5,6 --repeats 5 --replay
     wait ;;
  # session 11, the final code (the adaptive k's host work moved into the time the device runs a step):
  # PART=6: the codepair's whole table, every k, adaptive and replay (batch 1 on GPU 1, 4..64 on GPU 0);
  # PART=7: the 8B shape's rows, its best k of session 10 and those within 3 % of it (batch 1 on GPU 0,
  # 4 and then 16..64 on GPU 1); PART=8: issue 14's lockstep check (PAIRS interleaved pairs), every GPU test.
  6) ak 1 table_codepair_bs1_final --batches 1 --repeats 3 --replay &
     ak 0 table_codepair_final --batches 4,16,32,64 --repeats 5 --replay
     wait ;;
  7) a8 0 table_8b_bs1_final --batches 1 --ks 6 --repeats 3 &
     ( a8 1 table_8b_4_final --batches 4 --ks 4,5,6 --repeats 3
       a8 1 table_8b_16_64_final --batches 16,32,64 --ks 3,4,5,6 --repeats 3 )
     wait ;;
  8) runs=$(for i in $(seq ${PAIRS:-5}); do printf "2:always,2:always:adaptive,"; done)
     timeout $((45 * ${PAIRS:-5})) python3 benchmarks/dp_scaling.py --pair $P --method draft_model --work /tmp/dpwork-adaptive \
       --runs "${runs%,}" --json "$out/dp_adaptive.json" > "$out/dp_adaptive.log" 2>&1; grep -A3 "^medians" "$out/dp_adaptive.log"
     timeout $(left) python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
     tail -3 "$out/gpu_tests.log" ;;
  9) # the 8B shape's other fixed k (session 7: <= 0.93 x the best), as far as the time box reaches
     ( a8 0 table_8b_bs1_k5_final --batches 1 --ks 5 --no-adaptive --repeats 3
       a8 0 table_8b_4_k123_final --batches 4 --ks 1,2,3 --no-adaptive --repeats 3 ) &
     ( a8 1 table_8b_16_64_k012_final --batches 16,32,64 --ks 0,1,2 --no-adaptive --repeats 3
       a8 1 table_8b_4_k0_final --batches 4 --ks 0 --no-adaptive --repeats 3 )
     wait ;;
  esac
  wait; tail -n 4 "$out"/*.log
  ;;
refactor)
  # session 12 (issue 28: the plan, the per-family model files, the step as schedule -> execute -> update):
  # the offline rows before and after on one machine, interleaved. OLD: a copy of the code before (e.g.
  # `git archive 8fd26ff specdp_cli benchmarks | tar -x -C .bench/old`), run by its own benchmarks/offline.py.
  # PART=1: every GPU test, then the codepair at batch 1 and 32 (none, draft_model, eagle), old / new / old / new;
  # PART=2: the 8B-shaped target at batch 1 and 16 (none, draft_model), old / new / old / new;
  # PART=3: the codepair at batch 32 over 256 requests (none, draft_model), old / new / old / new;
  # PART=4: PART=1's codepair rows alone; PART=5: none and eagle over 256 requests at batch 1 and 32.
  OLD=${OLD:-.bench/old}
  pair() {   # NAME ARGS...: the same offline rows by the old code and the new, twice, alternating
    name=$1; shift
    for i in 1 2; do
      for v in old new; do
        dir=.; [ $v = old ] && dir=$OLD
        timeout 240 python3 $dir/benchmarks/offline.py "$@" --json "$out/${name}_${v}_$i.json" > /tmp/${name}_${v}_$i.log 2>&1 \
          || { echo "== ${name} $v $i failed"; tail -20 /tmp/${name}_${v}_$i.log; }
      done
    done
  }
  case "${PART:-1}" in
  1) timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
     tail -3 "$out/gpu_tests.log"
     pair codepair --pair $P --batches 1,32 --methods none,draft_model,eagle ;;
  2) widen || exit 1
     pair widened --pair $P --target $W/target --prompts 16 --batches 1,16 --methods none,draft_model --label widened ;;
  3) # the codepair at batch 32 over 256 requests (a step's host work, 8x the steps of PART=1's rows)
     pair codepair256 --pair $P --requests 256 --batches 32 --methods none,draft_model ;;
  4) # PART=1's codepair rows alone, without the GPU tests
     pair codepair --pair $P --batches 1,32 --methods none,draft_model,eagle ;;
  5) # the host-bound rows over 256 requests (batch 1: 32,768 steps a row), to see a few microseconds a step
     pair codepair256b1 --pair $P --requests 256 --batches 1,32 --methods none,eagle ;;
  esac
  python3 - "$out" <<'PY'
import glob, json, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*_[on]*_[12].json")):
    name, v, i = f.rsplit("/", 1)[1][:-5].rsplit("_", 2)
    for r in json.load(open(f)).get("rows", []):
        rows.setdefault((name, r["method"], r["batch"]), {}).setdefault(v, []).append(r["tok_s"])
for (name, m, b), d in sorted(rows.items()):
    o, n = d.get("old", []), d.get("new", [])
    ratio = (sum(n) / len(n)) / (sum(o) / len(o)) if o and n else float("nan")
    print(f"{name:10s} {m:12s} bs {b:3d}  old {o}  new {n}  new/old {ratio:.3f}")
PY
  ;;
moe)
  # session 13 (issue 29: only the routed experts run; expert parallelism inside CUDA graphs).
  # PART=1: one MoE layer's routed experts, the Triton kernels against PyTorch's grouped GEMM (and a tile sweep);
  #   the Qwen3-30B-A3B shape (8 layers) at batch 1, 16, 64 against the weight-read limit and Hugging Face;
  #   then the MoE GPU tests (kernels = reference, graphs = eager per MoE family).
  # PART=2: the MoE demo (benchmarks/train_moe_pair.py, trained here on benchmarks/train_pair.py's corpus: the
  #   target with its MTP layer trained for recursive drafting, MOE_MINUTES (2.5), then the codepair draft
  #   distilled from it, MOE_DRAFT_MINUTES (1.5): 4 minutes, plus the corpus' encoding and the evaluations)
  #   none / draft_model / mtp at batch 1 and 32 (k 4), and at k MOE_KS (1 2 3) at batch 1 (MOE_BATCHES, MOE_METHODS,
  #   MOE_K_METHODS choose fewer rows; MOE_ASYNC=off: synchronous steps; REPEATS (3): runs a row, median).
  # PART=3: every GPU test. PART=4 (2 GPUs): expert parallelism, experts split vs replicated, in CUDA graphs.
  # PART=5: the end-to-end shapes alone (Qwen3-30B-A3B with a host / device split of its batch-1 step, then
  #   DeepSeek-V3).
  case "${PART:-1}" in
  1) timeout 150 python3 benchmarks/moe_kernel.py --sweep --json "$out/moe_kernel.json" > /tmp/moe_kernel.log 2>&1 \
       || tail -20 /tmp/moe_kernel.log
     sed -n '/^shape /,$p' /tmp/moe_kernel.log
     timeout 240 python3 benchmarks/moe_shapes.py --pair $P --work /tmp/moe_shapes --shapes qwen3_30b_a3b \
       --batches 1,16,64 --profile "${PROFILE:-}" --json "$out/moe_shapes_qwen3.json" > /tmp/moe_shapes.log 2>&1 \
       || tail -20 /tmp/moe_shapes.log
     [ -n "${PROFILE:-}" ] && grep -B2 -A24 "Self CUDA %" /tmp/moe_shapes.log | head -60
     sed -n '/^shape /,$p' /tmp/moe_shapes.log
     timeout 180 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "routed or routing or moe_graphs" \
       > "$out/gpu_tests_moe.log" 2>&1; tail -15 "$out/gpu_tests_moe.log" ;;
  5) timeout 240 python3 benchmarks/moe_shapes.py --pair $P --work /tmp/moe_shapes --shapes qwen3_30b_a3b \
       --batches 1,16,64 --json "$out/moe_shapes_qwen3.json" > /tmp/moe_shapes.log 2>&1 || tail -20 /tmp/moe_shapes.log
     sed -n '/^shape /,$p' /tmp/moe_shapes.log
     timeout 120 python3 benchmarks/step_probe.py --pair /tmp/moe_shapes/qwen3_30b_a3b --methods none --new 64 \
       --max-model-len 1024 --no-eager-profile --json "$out/step_probe_qwen3.json" > /tmp/step_probe.log 2>&1 || tail -20 /tmp/step_probe.log
     grep -v "^{" /tmp/step_probe.log | tail -30
     timeout 300 python3 benchmarks/moe_shapes.py --pair $P --work /tmp/moe_shapes --shapes deepseek_v3 \
       --batches 1,16,64 --json "$out/moe_shapes_deepseek.json" > /tmp/moe_shapes_ds.log 2>&1 || tail -20 /tmp/moe_shapes_ds.log
     sed -n '/^shape /,$p' /tmp/moe_shapes_ds.log ;;
  2) # the corpus is encoded by the tokenizer's threads (single-threaded it takes minutes)
     TOKENIZERS_PARALLELISM=true timeout 420 python3 benchmarks/train_moe_pair.py --pair $P --corpus benchmarks/train_pair.py --out /tmp/moepair \
       --minutes ${MOE_MINUTES:-2.5} --draft-minutes ${MOE_DRAFT_MINUTES:-1.5} > "$out/train_moe_pair.log" 2>&1 \
       || tail -20 "$out/train_moe_pair.log"
     cp /tmp/moepair/train_report.json "$out/" 2>/dev/null
     grep -E '^(corpus:|mtp \{|draft \{)' "$out/train_moe_pair.log"
     grep '^step ' "$out/train_moe_pair.log" | tail -1; grep '^draft step ' "$out/train_moe_pair.log" | tail -1
     offline moe_demo --pair /tmp/moepair --batches ${MOE_BATCHES:-1,32} --methods ${MOE_METHODS:-none,draft_model,mtp} \
       --k 4 --async-scheduling ${MOE_ASYNC:-auto} --repeats ${REPEATS:-3} --label moe-demo
     sed -n '/^method/,$p' /tmp/moe_demo.log
     for k in ${MOE_KS:-1 2 3}; do
       offline moe_demo_k$k --pair /tmp/moepair --batches 1 --methods ${MOE_K_METHODS:-mtp,draft_model} --k $k \
         --async-scheduling ${MOE_ASYNC:-auto} --repeats ${REPEATS:-3} --label moe-demo
       grep -v "^device copy" /tmp/moe_demo_k$k.log | sed -n '/^method/,$p' | tail -n +2
     done ;;
  3) timeout 540 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
     tail -15 "$out/gpu_tests.log" ;;
  4) python3 benchmarks/dp_scaling.py --pair /tmp/moepair --method none --runs "1:always,2:always,2:ep,2:always,2:ep" \
       --work /tmp/dpwork-moe --json "$out/dp_scaling_moe.json" 2>&1 | tail -12 ;;
  esac
  ;;
fp8)
  # issue 30 (FP8). PART=1: the FP8 GPU tests, then the block-scaled GEMM against cuBLAS's and bf16 (with a decode
  # tile sweep). PART=2: the 8B shape bf16 vs FP8 quantized at load (batch 1 and 16, median of 3, greedy agreement),
  # then the Qwen3-30B-A3B shape bf16 vs FP8 at batch 1 (FP8 rows per decode activation mode, FP8_DECODE_MODES).
  # Without PART: both; PART=gemm: both without the tests (SWEEP= leaves the tile sweep out). PART=trace: kernel
  # timelines of the 8B shape's batch-1 step in bf16 and FP8 (FP8_DECODE_MODES).
  case "${PART:-all}" in 1|all|gemm)
    [ "${PART:-all}" != gemm ] && timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k fp8 > "$out/gpu_tests_fp8.log" 2>&1
    [ "${PART:-all}" != gemm ] && tail -15 "$out/gpu_tests_fp8.log"
    timeout 240 python3 benchmarks/fp8_gemm.py ${SWEEP---sweep} --json "$out/fp8_gemm.json" > "$out/fp8_gemm.log" 2>&1 \
      || tail -20 "$out/fp8_gemm.log"
    grep -E "^sweep|^shape|^8b|^a3b" "$out/fp8_gemm.log" ;;
  esac
  if [ "${PART:-all}" = trace ]; then     # the 8B shape's batch-1 step, bf16 and FP8, kernel by kernel
    widen || exit 1
    timeout 300 python3 benchmarks/fp8.py --pair $P --target $W/target --label 8b-shape --prompts 1 --batches 1 --new 64 \
      --repeats 1 --decode-modes ${FP8_DECODE_MODES:-quantize} --trace /tmp/fp8trace --json "$out/fp8_8b_trace.json" \
      > "$out/fp8_8b_trace.log" 2>&1 || tail -20 "$out/fp8_8b_trace.log"
    grep "^profile:" "$out/fp8_8b_trace.log"
    for f in /tmp/fp8trace_*_b1.json; do
      echo "== $f"; python3 benchmarks/kernel_timeline.py "$f" --order ${ORDER:-12} --json "$out/kernel_timeline_$(basename "$f")"
    done
  fi
  case "${PART:-all}" in 2|all|gemm)
    widen || exit 1
    timeout 330 python3 benchmarks/fp8.py --pair $P --target $W/target --label 8b-shape --prompts 16 --batch1-prompts 8 \
      --batches 1,16 --repeats 3 --decode-modes ${FP8_DECODE_MODES:-quantize,gemv} --json "$out/fp8_8b.json" > "$out/fp8_8b.log" 2>&1 || tail -20 "$out/fp8_8b.log"
    sed -n '/^method /,$p' "$out/fp8_8b.log"
    timeout 200 python3 benchmarks/fp8.py --pair $P --moe-shape qwen3_30b_a3b --work /tmp/moe_shapes --prompts 4 \
      --prompt-len 32 --batches 1 --repeats 3 --decode-modes ${FP8_DECODE_MODES:-quantize,gemv} --json "$out/fp8_qwen3_30b_a3b.json" > "$out/fp8_moe.log" 2>&1 \
      || tail -20 "$out/fp8_moe.log"
    sed -n '/^method /,$p' "$out/fp8_moe.log" ;;
  esac
  ;;
prefix)
  # issue 33 / 31 on one GPU: every GPU test (the request fields and prefix caching in CUDA graphs among them), then
  # prefix caching on the codepair pair: requests sharing a 1,500-token prefix, caching on vs off (TTFT, throughput)
  timeout ${GPU_TEST_S:-420} python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
  tail -8 "$out/gpu_tests.log"
  timeout 200 python3 benchmarks/prefix_cache.py --pair $P --device cuda --prefix 1500 --requests ${REQUESTS:-64} \
    --max-tokens 32 --max-num-seqs 32 --json "$out/prefix_cache_codepair.json" > "$out/prefix_cache.log" 2>&1 \
    || tail -20 "$out/prefix_cache.log"
  grep -v Loading "$out/prefix_cache.log" | tail -5
  ;;
gemv)
  # session 18's experiment: a matrix-vector Triton kernel for the decode projections against cuBLAS (M 1..8), then
  # the Qwen3-30B-A3B and DeepSeek-V3 shapes end to end at batch 1 / 16 / 64 (async scheduling on: the default)
  timeout 150 python3 benchmarks/gemv_decode.py --json "$out/gemv_decode.json" > "$out/gemv_decode.log" 2>&1 \
    || tail -20 "$out/gemv_decode.log"
  grep -v -i warn "$out/gemv_decode.log" | tail -40
  timeout 300 python3 benchmarks/moe_shapes.py --pair $P --work /tmp/moe_shapes --batches 1,16,64 --hf-batches "" \
    --json "$out/moe_shapes.json" > /tmp/moe_shapes.log 2>&1 || tail -20 /tmp/moe_shapes.log
  sed -n '/^shape /,$p' /tmp/moe_shapes.log
  ;;
batch1)
  # session 19: the GPU tests of what changed (async scheduling with EAGLE / MTP, the fused routed sum, the one-row
  # o projection, graphs = eager for every method and MoE family), then the Qwen3-30B-A3B shape at batch 1 and 64
  # with a kernel timeline of the batch-1 step
  timeout ${GPU_TEST_S:-300} python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    -k "${GPU_TESTS_K:-async or fused or one_row or graphs_equal_eager or moe_graphs or routed or routing}" \
    > "$out/gpu_tests.log" 2>&1; tail -12 "$out/gpu_tests.log"
  timeout 200 python3 benchmarks/moe_shapes.py --pair $P --work /tmp/moe_shapes --shapes qwen3_30b_a3b --batches ${QWEN_BATCHES:-1,64} \
    --hf-batches "" --profile 1 --trace /tmp/trace --json "$out/moe_shapes_qwen3.json" > /tmp/moe_shapes.log 2>&1 \
    || tail -20 /tmp/moe_shapes.log
  sed -n '/^shape /,$p' /tmp/moe_shapes.log
  python3 benchmarks/kernel_timeline.py /tmp/trace_qwen3_30b_a3b_b1.json --json "$out/kernel_timeline_qwen3_b1.json" \
    2>&1 | tail -45
  ;;
s21)
  # session 21's one call: the GPU tests of what changed (split-K sums by a tile's last program, activation
  # quantization inside the norms, split-KV decode attention), the attention and FP8 GEMM microbenchmarks, then the
  # 8B shape bf16 vs FP8 at batch 1 and 16 (median of 3; FP8_DECODE_MODES: each change on and off), then offline eagle
  timeout ${GPU_TEST_S:-200} python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    -k "${GPU_TESTS_K:-fp8 or attention or graphs_equal_eager}" > "$out/gpu_tests.log" 2>&1; tail -6 "$out/gpu_tests.log"
  [ -f benchmarks/attention_decode.py ] && { timeout 90 python3 benchmarks/attention_decode.py --json "$out/attention_decode.json" \
    > "$out/attention_decode.log" 2>&1 || tail -5 "$out/attention_decode.log"; tail -28 "$out/attention_decode.log"; }
  if [ "${GEMM:-1}" = 1 ]; then
    timeout 120 python3 benchmarks/fp8_gemm.py --rows 1,16 --json "$out/fp8_gemm.json" > "$out/fp8_gemm.log" 2>&1 \
      || tail -10 "$out/fp8_gemm.log"
    sed -n '/^shape /,$p' "$out/fp8_gemm.log"
  fi
  [ "${E2E:-1}" = 1 ] && widen && timeout ${E2E_S:-330} python3 benchmarks/fp8.py --pair $P --target $W/target --label 8b-shape --prompts 16 --batch1-prompts 8 \
    --batches 1,16 --repeats 3 --decode-modes ${FP8_DECODE_MODES:-quantize} --json "$out/fp8_8b.json" > "$out/fp8_8b.log" 2>&1 \
    || tail -20 "$out/fp8_8b.log"
  [ -f "$out/fp8_8b.log" ] && sed -n '/^method /,$p' "$out/fp8_8b.log"
  if [ "${EAGLE:-1}" = 1 ]; then    # host time at batch 32: session 20's engine (.bench/old_s20.tar: `git archive -o
    # .bench/old_s20.tar 3433a38 specdp_cli benchmarks/offline.py benchmarks/workloads.py`) against this one, in turn
    mkdir -p /tmp/old && tar -xf .bench/old_s20.tar -C /tmp/old && ln -sfn "$PWD/.bench" /tmp/old/.bench
    for side in ${SIDES:-old new old new}; do
      py=benchmarks/offline.py; [ $side = old ] && py=/tmp/old/benchmarks/offline.py
      CUDA_VISIBLE_DEVICES=0 timeout 100 python3 $py --pair $P --requests 256 --batches 32 --repeats 5 --methods eagle \
        --label $side --json "$out/offline_eagle_$side.$SECONDS.json" > /tmp/off_$side.log 2>&1 || tail -5 /tmp/off_$side.log
      echo "$side: $(grep '^eagle' /tmp/off_$side.log)"
    done
  fi
  ;;
s22)
  # session 22 (issue 30): programmatic dependent launch on an 8B-shaped layer chain (benchmarks/pdl_chain.py), then
  # what the kernel timelines pointed at: the FP8 decode GEMM's pipeline depth on cold weights (its small
  # projections stream at 1.9-2.5 TB/s, cuBLAS's bf16 ones at 3.2-4.2) and the FP8 routed experts' tiles (16.6 µs
  # for gate/up at one token on the Qwen3-30B-A3B shape, bf16 14.9). End to end: PART=2 of the fp8 stage, e.g. with
  # FP8_DECODE_MODES=quantize,quantize-nopdl,quantize-expertsplain,bf16-expertsplain (the FP8 MoE shape lost 9 % with
  # PDL in session 22).
  # a step's time box 0 leaves it out
  [ "${CHAIN_S:-150}" != 0 ] && timeout ${CHAIN_S:-150} python3 benchmarks/pdl_chain.py --json "$out/pdl_chain.json" 2>&1 \
    | grep -v -i warn | tail -26
  [ "${STAGES_S:-240}" != 0 ] && timeout ${STAGES_S:-240} python3 benchmarks/fp8_gemm.py --sweep-stages --json "$out/fp8_gemm_stages.json" \
    > "$out/fp8_gemm_stages.log" 2>&1; grep -v -i -E "warn|^skip" "$out/fp8_gemm_stages.log" | tail -14
  [ "${MOE_S:-150}" != 0 ] && timeout ${MOE_S:-150} python3 benchmarks/moe_kernel.py --shapes qwen3_30b_a3b --tokens 1,16 --fp8 --sweep \
    --json "$out/moe_kernel_fp8.json" > "$out/moe_kernel_fp8.log" 2>&1; sed -n '/^shape /,$p' "$out/moe_kernel_fp8.log"
  ;;
s24)
  # session 24 (issue 33): whether this machine's CPUs run Python alike (benchmarks/core_probe.py), then offline eagle
  # pinned to the fastest and the slowest CPU the probe found, alternating (PINNED_RUNS pairs): does a rank's step
  # follow its CPU? Then the shared-prefix check with several load-generating processes (WORKERS, default 4).
  timeout 120 python3 benchmarks/core_probe.py --rounds 3 --json "$out/core_probe.json" 2>&1 | tail -24
  read fast slow < <(python3 -c "
import json, statistics
r = json.load(open('$out/core_probe.json'))['rows']
m = sorted((statistics.median(x['alone_ms']), x['cpu']) for x in r)
print(m[0][1], m[-1][1])")
  for i in $(seq ${PINNED_RUNS:-2}); do
    for cpu in $fast $slow; do
      CUDA_VISIBLE_DEVICES=0 timeout 120 taskset -c $cpu python3 benchmarks/offline.py --pair $P --requests 256 --batches 32 \
        --repeats 3 --methods eagle --label cpu$cpu --json "$out/offline_eagle_cpu${cpu}_$i.json" > /tmp/pin.log 2>&1 \
        || tail -5 /tmp/pin.log
      python3 -c "import json; r = json.load(open('$out/offline_eagle_cpu${cpu}_$i.json'))['rows'][0]; \
print('cpu $cpu run $i', {k: r[k] for k in r if 'tok' in k or 'ms' in k})"
    done
  done
  [ "${PREFIX_S:-200}" != 0 ] && timeout ${PREFIX_S:-200} python3 benchmarks/serve_bench.py --pair $P --methods draft_model \
    --prefix 1500 --caching on,off --client-workers ${WORKERS:-4} --max-tokens 32 --label prefix32 --work /tmp/sw24 \
    --json "$out/serve_prefix_32.json" 2>&1 | tail -5
  ;;
s25)
  # session 25 (issues 33, 30): a step with prompt chunks runs every row at the chunk width (16 tokens); with
  # caching on most steps carry a short tail chunk. The same offline workload with 16-token and k+1-token chunk rows
  # (CHUNK_ROW_TOKENS; 5 makes chunk steps as narrow as decode steps), each with caching on and off. Then the GPU
  # tests of session 23's mend.
  # The closed loop (each request replaced as it finishes, as served) also with HOLD_SHARE 1: async scheduling plans
  # every step ahead, sequences near their limit sitting it out.
  for v in ${VARIANTS:-crt16 crt5 hold1}; do
    case $v in crt*) opt="--chunk-row-tokens ${v#crt}";; hold*) opt="--hold-share ${v#hold}";; esac
    CUDA_VISIBLE_DEVICES=0 timeout ${PC_S:-150} python3 benchmarks/prefix_cache.py --pair $P --device cuda --prefix 1500 \
      --requests 256 --max-tokens 32 --max-num-seqs 32 --max-batched-tokens ${MBT:-16384} --method ${METHOD:-draft_model} \
      --closed-loop $opt --json "$out/prefix_cache_$v.json" > "$out/prefix_cache_$v.log" 2>&1
    echo "== $v"; tail -4 "$out/prefix_cache_$v.log"
  done
  [ "${TESTS:-1}" != 0 ] && timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TESTS_K:-fp8 or moe_sum or pdl or norm}" \
    -p no:cacheprovider 2>&1 | tail -8
  ;;
s25b)
  # session 25, call 2: the closed loop with HOLD_SHARE 0.25 / 0.5 / 1; then served, the seconds the rank waits for
  # requests (/metrics' rank_idle_seconds): the shared-prefix run with caching on (WORKERS load processes), and one
  # round of each method on the codepair workload
  for v in ${VARIANTS:-hold0.25 hold0.5 hold1}; do
    CUDA_VISIBLE_DEVICES=0 timeout ${PC_S:-150} python3 benchmarks/prefix_cache.py --pair $P --device cuda --prefix 1500 \
      --requests 256 --max-tokens 32 --max-num-seqs 32 --max-batched-tokens 16384 --method ${METHOD:-draft_model} \
      --closed-loop --hold-share ${v#hold} --json "$out/prefix_cache_$v.json" > "$out/prefix_cache_$v.log" 2>&1
    echo "== $v"; tail -4 "$out/prefix_cache_$v.log"
  done
  timeout 150 python3 benchmarks/serve_bench.py --pair $P --methods draft_model --prefix 1500 --caching on \
    --client-workers ${WORKERS:-4} --max-tokens 32 --label prefix32 --work /tmp/sw25 --json "$out/serve_prefix_32_on.json" \
    2>&1 | tail -2
  m=none,draft_model; [ -d $P/eagle ] && m=$m,eagle
  timeout ${SERVE_S:-240} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers ${WORKERS:-4} --rounds 1 \
    --no-offline --work /tmp/sw25b --json "$out/serve_codepair_idle.json" 2>&1 | tail -4
  ;;
s25c)
  # session 25, call 3: the frontend's capacity on this machine (benchmarks/frontend_bench.py: a stand-in rank, no model):
  # the shared-prefix shape (1,500-token prefix, 32 new tokens) and the codepair shape (128 new tokens, 2 a step)
  for spec in "--prefix 1500 --max-tokens 32 --step-ms 1" "--prefix 1500 --max-tokens 32 --step-ms 0.5" \
              "--max-tokens 128 --tokens-per-step 2 --step-ms 0.8"; do
    timeout 120 python3 benchmarks/frontend_bench.py --tokenizer $P/tokenizer --requests ${REQS:-1024} \
      --client-workers ${WORKERS:-4} $spec --json "$out/frontend_$(echo $spec | tr -d ' -' ).json" 2>&1 | tail -1
  done
  ;;
s25d)
  # session 25, call 4: several API server processes (server.api_server_count = APIS, default 2): the shared-prefix
  # check (caching on and off), then served against offline for each method (3 rounds, WORKERS load processes)
  [ "${PREFIX:-1}" != 0 ] && timeout 240 python3 benchmarks/serve_bench.py --pair $P --methods draft_model --prefix 1500 \
    --caching on,off --client-workers ${WORKERS:-4} --api-servers ${APIS:-2} --max-tokens 32 --label prefix32-api${APIS:-2} \
    --work /tmp/sw25d --json "$out/serve_prefix_32_api${APIS:-2}.json" 2>&1 | tail -3
  m=none,draft_model; [ -d $P/eagle ] && m=$m,eagle
  [ "${MAIN:-1}" != 0 ] && timeout ${SERVE_S:-330} python3 benchmarks/serve_bench.py --pair $P --methods ${METHODS:-$m} \
    --client-workers ${WORKERS:-4} --api-servers ${APIS:-2} --label api${APIS:-2} --work /tmp/sw25e \
    --json "$out/serve_codepair_api${APIS:-2}.json" 2>&1 | tail -5
  ;;
s26)
  # session 26 (issue 33): why a served rank's steps take longer than offline's.
  # 1. The VM's CPUs (benchmarks/core_probe.py): N pure-Python loops at once, and two victim CPUs beside a busy loop on
  #    each other CPU (shared cores the topology does not show).
  [ "${PROBE:-1}" != 0 ] && timeout 120 python3 benchmarks/core_probe.py --rounds 2 --pairs 0,9 --parallel 1,2,4,8,16 \
    --json "$out/core_probe.json" 2>&1 | grep -E "^parallel|^victim|^alone"
  # 2. Offline eagle alone and beside a served load with no model (frontend_bench.py: the frontend, a stand-in rank and
  #    4 load processes at eagle's 3 tokens a step), one process's runs classified by the load's wall-clock window.
  if [ "${BESIDE:-1}" != 0 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/offline.py --pair $P --requests 256 --batches 32 \
      --repeats ${REPEATS:-150} --methods eagle --label beside --json "$out/offline_eagle_beside.json" > /tmp/ob.log 2>&1 &
    ob=$!
    for i in $(seq 1200); do grep -q "^# measuring" /tmp/ob.log && break; sleep 0.1; done
    sleep ${QUIET_S:-8}
    fb0=$(date +%s.%N)
    timeout 120 python3 benchmarks/frontend_bench.py --tokenizer $P/tokenizer --step-ms 0.7 --tokens-per-step 3 \
      --requests ${FB_REQ:-3000} --client-workers 4 --json "$out/frontend_load.json" 2>&1 | tail -2
    fb1=$(date +%s.%N)
    wait $ob || tail -5 /tmp/ob.log
    python3 - "$out/offline_eagle_beside.json" "$out/frontend_load.json" $fb0 $fb1 <<'PY'
import json, statistics, sys
row = json.load(open(sys.argv[1]))["rows"][0]
fb = json.load(open(sys.argv[2]))
fb0, fb1 = float(sys.argv[3]), float(sys.argv[4])
alone, beside = [], []
for t0, s, tps in zip(row["runs_t0"], row["runs_s"], row["tok_s_runs"]):
    if t0 + s < fb0 or t0 > fb1:
        alone.append(tps)
    elif t0 >= fb["client_t0"] and t0 + s <= fb["client_t1"]:
        beside.append(tps)
for name, xs in (("alone", alone), ("beside the served load", beside)):
    if xs:
        print(f"offline eagle {name}: {len(xs)} runs, median {statistics.median(xs):,.0f} tok/s, "
              f"min {min(xs):,.0f}, max {max(xs):,.0f}")
if alone and beside:
    print(f"beside / alone: {statistics.median(beside) / statistics.median(alone):.2f}")
PY
  fi
  # 3. Served against offline with their rounds taking turns (serve_bench.py --interleave), one API server.
  m=eagle,none; [ -d $P/eagle ] || m=none
  [ "${MAIN:-1}" != 0 ] && timeout ${SERVE_S:-400} python3 benchmarks/serve_bench.py --pair $P --methods ${METHODS:-$m} \
    --client-workers ${WORKERS:-4} --api-servers ${APIS:-1} --rounds ${ROUNDS:-5} --interleave --label interleaved \
    --work /tmp/sw26 --json "$out/serve_interleaved.json" 2>&1 | tail -4
  ;;
s26b)
  # session 26: the serving rank before (.bench/old: the package of the commit before, its links read by reader threads,
  # an async step's tokens sent a step later) and after, each against offline with interleaved rounds, alternating
  # (VARIANTS); then the other methods with the new code (METHODS2); RANK_CPU=N: the ranks and the offline process on
  # CPU N, the rest on the others (serve_bench.py --rank-cpu). The old package runs from a copy of the
  # repository's benchmarks beside it (its own cwd and PYTHONPATH: `python -m` and the ranks import it from there).
  rm -rf /tmp/old && mkdir -p /tmp/old && cp -r .bench/old/specdp_cli /tmp/old/ && cp -r benchmarks /tmp/old/
  sb() {   # VARIANT METHOD NAME: one interleaved serve_bench run (old: from /tmp/old, its package first)
    local dir=$PWD path=$PYTHONPATH
    [ "$1" = old ] && dir=/tmp/old path=/tmp/old:/tmp/site
    (cd $dir && PYTHONPATH=$path timeout 240 python3 benchmarks/serve_bench.py --pair "$OLDPWD/$P" --methods $2 \
      --client-workers ${WORKERS:-4} --api-servers ${APIS:-1} --rounds ${ROUNDS:-15} --interleave \
      ${RANK_CPU:+--rank-cpu $RANK_CPU} --label $1 --work /tmp/sw26b_$3 --json "$out/serve_$3.json" 2>&1 | tail -1)
  }
  i=0
  for v in ${VARIANTS:-old new}; do
    i=$((i + 1)); for m in ${METHODS:-eagle}; do sb $v $m ${v}_${m}_$i; done
  done
  for m in ${METHODS2:-none draft_model}; do sb new $m new_$m; done
  # the 1,500-token shared prefix, caching on and off (PREFIX=0: not run)
  [ "${PREFIX:-0}" != 0 ] && timeout 240 python3 benchmarks/serve_bench.py --pair $P --methods draft_model --prefix 1500 \
    --caching on,off --client-workers ${WORKERS:-4} --api-servers ${APIS:-1} --max-tokens 32 --label prefix32 \
    --interleave --rounds ${PREFIX_ROUNDS:-9} ${RANK_CPU:+--rank-cpu $RANK_CPU} --work /tmp/sw26p --json "$out/serve_prefix_32.json" 2>&1 | tail -3
  ;;
s27)
  # session 27 (issue 33): the frontend's event loop, asyncio against uvloop (frontend_bench.py, a stand-in rank, in
  # turn), then served against offline taking turns (serve_bench.py --interleave), ranks and offline on CPU RANK_CPU,
  # with two API servers and with one (RUNS: API_SERVERS:METHOD ...)
  for i in $(seq ${FE_ROUNDS:-3}); do for L in asyncio uvloop; do
    timeout 90 python3 benchmarks/frontend_bench.py --tokenizer $P/tokenizer --step-ms 0.7 --tokens-per-step 3 \
      --requests 1024 --client-workers 4 --rank-cpu ${RANK_CPU:-3} --event-loop $L --json "$out/frontend_${L}_$i.json" \
      2>&1 | tail -1 | sed "s/^/$L /"
  done; done
  for run in ${RUNS:-2:eagle 1:eagle 2:none 2:draft_model}; do
    apis=${run%%:*}; m=${run#*:}
    timeout 240 python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers ${WORKERS:-4} --api-servers $apis \
      --rounds ${ROUNDS:-9} --interleave --rank-cpu ${RANK_CPU:-3} --label api$apis --work /tmp/sw27_${apis}_$m \
      --json "$out/serve_api${apis}_$m.json" 2>&1 | tail -1 | sed "s/^/api$apis /"
  done
  ;;
s27b)
  # session 27: issue 30's draft_model row (the 8B shape, bf16 and FP8 quantized at load, `none` and `draft_model`,
  # batch 1 and 16, median of 3; FP8_S, default 330 s), issue 33's 8B served check taking turns with offline
  # (SERVE8B_S), then the GPU tests (GPU_TEST_S; GPU_TESTS_K, all when unset); a part with its time box 0 is left out,
  # as SERVE8B_S and GPU_TEST_S are unless set
  end=$((SECONDS + ${LIMIT:-570}))
  widen || exit 1
  [ "${FP8_S:-330}" != 0 ] && { timeout ${FP8_S:-330} python3 benchmarks/fp8.py --pair $P --target $W/target --label 8b-shape \
    --methods none,draft_model --prompts 16 --batch1-prompts ${B1_PROMPTS:-4} --batches 1,16 --repeats 3 \
    --decode-modes quantize --json "$out/fp8_8b_methods.json" > "$out/fp8_8b_methods.log" 2>&1 \
    || tail -20 "$out/fp8_8b_methods.log"; sed -n '/^method /,$p' "$out/fp8_8b_methods.log"; }
  [ "${SERVE8B_S:-0}" != 0 ] && timeout $(( $(left) < SERVE8B_S ? $(left) : SERVE8B_S )) python3 benchmarks/serve_bench.py \
    --pair $P --target $W/target --methods ${METHODS8B:-none,draft_model} --concurrency 16 --requests 64 --rounds ${ROUNDS:-5} \
    --interleave --rank-cpu ${RANK_CPU:-3} --label 8b --work /tmp/sw27b --json "$out/serve_8b.json" 2>&1 | tail -3
  [ "${GPU_TEST_S:-0}" != 0 ] && { timeout $(( $(left) < GPU_TEST_S ? $(left) : GPU_TEST_S )) python3 -m pytest -q -m gpu \
    tests/test_gpu.py -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} > "$out/gpu_tests.log" 2>&1; tail -8 "$out/gpu_tests.log"; }
  ;;
s27c)
  # session 27 (issue 30): a batch of 16 verifying 4 drafts is 80 rows, between the Triton decode tiles (<= 64 rows)
  # and cuBLAS's (>= 128): the GEMMs at those rows (Triton's tiles for that M, cuBLAS, bf16), the 8B shape's none /
  # draft_model rows at batch 16 with the Triton tiles and with cuBLAS from 65 rows, then the FP8 GEMM's GPU test
  # (session 27's call 3 ran it with the decode tiles widened to 127 rows, not kept)
  timeout 120 python3 benchmarks/fp8_gemm.py --rows ${ROWS:-16,80} --json "$out/fp8_gemm_rows.json" > "$out/fp8_gemm_rows.log" 2>&1 \
    || tail -10 "$out/fp8_gemm_rows.log"
  sed -n '/^shape /,$p' "$out/fp8_gemm_rows.log"
  widen || exit 1
  timeout ${FP8_S:-300} python3 benchmarks/fp8.py --pair $P --target $W/target --label 8b-shape --methods none,draft_model \
    --prompts 16 --batches ${BATCHES:-16} --repeats 3 --decode-modes quantize,quantize-cublas --json "$out/fp8_8b_b16.json" \
    > "$out/fp8_8b_b16.log" 2>&1 || tail -20 "$out/fp8_8b_b16.log"
  sed -n '/^method /,$p' "$out/fp8_8b_b16.log"
  timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "fp8_gemm_matches_reference" 2>&1 | tail -4
  ;;
s28)
  # session 28 (issue 30): the GEMM's tiles at verification rows against bf16 and cuBLAS (fp8_gemm.py --sweep-rows,
  # SWEEP_S), the 8B shape's none / draft_model rows at batch 16 (FP8_S; BATCHES, MODES): verification rows as
  # shipped, on the prefill tile (-noverify, session 27's path) and on cuBLAS from 65 rows (-cublas); then the GPU
  # tests of the FP8 GEMM and the joined weights (GPU_TEST_S; GPU_TESTS_K)
  end=$((SECONDS + ${LIMIT:-560}))
  [ "${SWEEP_S:-170}" != 0 ] && { timeout ${SWEEP_S:-170} python3 benchmarks/fp8_gemm.py --sweep-rows ${ROWS:-48,80} \
    --json "$out/fp8_sweep_rows.json" > "$out/fp8_sweep_rows.log" 2>&1 || tail -5 "$out/fp8_sweep_rows.log"
    grep -v '^skip' "$out/fp8_sweep_rows.log"; }
  widen || exit 1
  [ "${FP8_S:-290}" != 0 ] && { timeout $(( $(left) < ${FP8_S:-290} ? $(left) : ${FP8_S:-290} )) python3 benchmarks/fp8.py \
    --pair $P --target $W/target --label 8b-shape --methods none,draft_model --prompts 16 --batches ${BATCHES:-16} \
    --repeats 3 --decode-modes ${MODES:-quantize,quantize-noverify,quantize-cublas} --json "$out/fp8_8b_b16.json" \
    > "$out/fp8_8b_b16.log" 2>&1 || tail -20 "$out/fp8_8b_b16.log"; sed -n '/^method /,$p' "$out/fp8_8b_b16.log"; }
  [ "${GPU_TEST_S:-80}" != 0 ] && { timeout $(( $(left) < ${GPU_TEST_S:-80} ? $(left) : ${GPU_TEST_S:-80} )) python3 -m pytest \
    -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "${GPU_TESTS_K:-fp8_gemm_matches_reference or joined}" \
    > "$out/gpu_tests.log" 2>&1; tail -8 "$out/gpu_tests.log"; }
  ;;
s29)
  # session 29 (issue 30): the GEMM at decode and verification rows (ROWS); then the same at MMAV3_ROWS with
  # Triton's wgmma turned off (DISABLE_MMA_V3: is the wait on each block's product what slows 64-row blocks?). The
  # published rows also had each weight tile scaled before its product (`weight_scaled`, commit 512b357; not kept)
  timeout ${SWEEP_S:-200} python3 benchmarks/fp8_gemm.py --sweep-rows ${ROWS:-16,80} --json "$out/fp8_sweep_rows.json" \
    > "$out/fp8_sweep_rows.log" 2>&1 || tail -5 "$out/fp8_sweep_rows.log"
  grep -v '^skip' "$out/fp8_sweep_rows.log"
  [ -n "${MMAV3_ROWS:-80}" ] && { DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-nomma3 timeout ${SWEEP_S:-200} python3 \
    benchmarks/fp8_gemm.py --sweep-rows ${MMAV3_ROWS:-80} --json "$out/fp8_sweep_rows_nomma3.json" \
    > "$out/fp8_sweep_rows_nomma3.log" 2>&1 || tail -5 "$out/fp8_sweep_rows_nomma3.log"
    grep -v '^skip' "$out/fp8_sweep_rows_nomma3.log"; }
  ;;
s29b)
  # session 29: the Qwen3-30B-A3B shape (8 layers) in FP8 against bf16 at batch 1 (issue 30's third check; MOE_S),
  # then the GPU tests of FP8 models with the attention writing o's input quantized, now the default (GPU_TEST_S)
  [ "${MOE_S:-200}" != 0 ] && { timeout ${MOE_S:-200} python3 benchmarks/fp8.py --pair $P --moe-shape qwen3_30b_a3b \
    --work /tmp/moe_shapes --prompts 4 --prompt-len 32 --batches 1 --repeats 3 --decode-modes quantize \
    --json "$out/fp8_qwen3_30b_a3b.json" > "$out/fp8_moe.log" 2>&1 || tail -20 "$out/fp8_moe.log"
    sed -n '/^method /,$p' "$out/fp8_moe.log"; }
  [ "${GPU_TEST_S:-300}" != 0 ] && { timeout ${GPU_TEST_S:-300} python3 -m pytest -q -m gpu tests/test_gpu.py \
    -p no:cacheprovider -k "${GPU_TESTS_K:-(fp8 or quantized) and not gemm_matches and not routed_expert}" \
    > "$out/gpu_tests.log" 2>&1; tail -8 "$out/gpu_tests.log"; }
  ;;
s29c)
  # session 29: the decode tiles of DECODE_TILES_29 against session 28's (-s28tiles), the 8B shape's none /
  # draft_model at batch 1 (8 prompts) and 16 (16 prompts), median of 3 (FP8_S); then the GEMM's GPU test (GPU_TEST_S)
  end=$((SECONDS + ${LIMIT:-250}))
  widen || exit 1
  timeout $(( $(left) < ${FP8_S:-190} ? $(left) : ${FP8_S:-190} )) python3 benchmarks/fp8.py --pair $P --target $W/target \
    --label 8b-shape --methods ${METHODS:-none,draft_model} --prompts 16 --batch1-prompts 8 --batches 1,16 --repeats 3 \
    --decode-modes ${MODES:-quantize,quantize-s28tiles} --json "$out/fp8_8b.json" > "$out/fp8_8b.log" 2>&1 \
    || tail -20 "$out/fp8_8b.log"
  sed -n '/^method /,$p' "$out/fp8_8b.log"
  [ "${GPU_TEST_S:-40}" != 0 ] && { timeout $(( $(left) < ${GPU_TEST_S:-40} ? $(left) : ${GPU_TEST_S:-40} )) python3 -m pytest \
    -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "${GPU_TESTS_K:-fp8_gemm_matches_reference}" \
    > "$out/gpu_tests.log" 2>&1; tail -4 "$out/gpu_tests.log"; }
  ;;
s36)
  # session 36 (issue 30): the FP8 GEMM's shipped tiles against a variant at decode and verification rows (SWEEP_S;
  # SWEEP_OPT: --swap, the product transposed, fp8_kernels' SWAP; --ahead, each K block's scales loaded a block
  # ahead, AHEAD; ROWS, SHAPES), then the 8B shape's none / draft_model rows (FP8_S; BATCHES, MODES: -swapdecode /
  # -swapverify / -swapall / -noswap / -nocublas / -ahead), then the GEMM's GPU test (GPU_TEST_S; GPU_TESTS_K)
  end=$((SECONDS + ${LIMIT:-570}))
  opt=${SWEEP_OPT:---swap}
  [ "${SWEEP_S:-230}" != 0 ] && { timeout ${SWEEP_S:-230} python3 benchmarks/fp8_gemm.py --sweep-rows ${ROWS:-1,16,80} $opt \
    --shapes ${SHAPES:-8b.qkv,8b.o,8b.gate_up,8b.down} --json "$out/fp8_sweep_${opt#--}.json" > "$out/fp8_sweep_${opt#--}.log" 2>&1 \
    || tail -5 "$out/fp8_sweep_${opt#--}.log"; grep -v -E '^skip|[Ww]arn' "$out/fp8_sweep_${opt#--}.log"; }
  widen || exit 1
  [ "${FP8_S:-250}" != 0 ] && { timeout $(( $(left) < ${FP8_S:-250} ? $(left) : ${FP8_S:-250} )) python3 benchmarks/fp8.py \
    --pair $P --target $W/target --label 8b-shape --methods ${METHODS:-none,draft_model} --prompts 16 --batch1-prompts 8 \
    --batches ${BATCHES:-16} --repeats 3 --decode-modes ${MODES:-quantize,quantize-swapverify,quantize-swapverify-nocublas} \
    --json "$out/fp8_8b.json" > "$out/fp8_8b.log" 2>&1 || tail -20 "$out/fp8_8b.log"; sed -n '/^method /,$p' "$out/fp8_8b.log"; }
  [ "${GPU_TEST_S:-60}" != 0 ] && { timeout $(( $(left) < ${GPU_TEST_S:-60} ? $(left) : ${GPU_TEST_S:-60} )) python3 -m pytest \
    -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "${GPU_TESTS_K:-fp8_gemm_matches_reference}" \
    > "$out/gpu_tests.log" 2>&1; tail -4 "$out/gpu_tests.log"; }
  ;;
s38)
  # session 38 (issue 30): s36 without its sweep, the 8B shape's rows (FP8_S; METHODS, BATCHES, MODES:
  # -noaddnormearly / -addnormearly), then GPU tests (GPU_TEST_S; GPU_TESTS_K). Session 38's calls also ran
  # `fp8_gemm.py --glu 1,16` first (GLU_S; the 8B's gate_up with silu_and_mul in the GEMM) and the modes -noglu /
  # -glu64 / -glu128 / -glu256: commit 6aa6ee7 (not kept) has that code and this stage as it ran.
  SWEEP_S=${SWEEP_S:-0} METHODS=${METHODS:-none} BATCHES=${BATCHES:-1,16} \
    MODES=${MODES:-quantize,quantize-noaddnormearly} GPU_TESTS_K=${GPU_TESTS_K:-add_norm} exec bash "$0" s36 "$out"
  ;;
s39)
  # session 39 (issue 30): the FP8 routed experts' W8A8 gate/up kernel reading x quantized before (moe_kernel.py
  # --sweep-set xq, one token's and TOKENS' experts; KERNEL_S), the Qwen3-30B-A3B shape (8 layers) at batch 1 in bf16
  # and FP8 with MOE_MODES (fp8.py's -noexpertsxq; MOE_S), its batch-1 step kernel by kernel in bf16 and FP8
  # (TRACE_S; TRACE_MODES), then GPU tests (GPU_TEST_S; GPU_TESTS_K). Session 39's first calls ran this stage at
  # commit a9e9d38 (--sweep-set split, MOE_MODES with -upsplit2 / -upsplit4: gate/up's K split over programs, not kept)
  end=$((SECONDS + ${LIMIT:-570}))
  [ "${KERNEL_S:-120}" != 0 ] && { timeout ${KERNEL_S:-120} python3 benchmarks/moe_kernel.py --shapes qwen3_30b_a3b \
      --tokens ${TOKENS:-1,4} --fp8 --sweep --sweep-set xq --all-experts-max-e 0 --json "$out/moe_kernel_xq.json" \
      > "$out/moe_kernel_xq.log" 2>&1 || tail -5 "$out/moe_kernel_xq.log"
    grep -E '^qwen3' "$out/moe_kernel_xq.log" | grep -v '{"' ; }
  [ "${MOE_S:-220}" != 0 ] && { timeout $(( $(left) < ${MOE_S:-220} ? $(left) : ${MOE_S:-220} )) python3 benchmarks/fp8.py \
      --pair $P --moe-shape qwen3_30b_a3b --work /tmp/moe_shapes --prompts 4 --prompt-len 32 --batches 1 --repeats 3 \
      --decode-modes ${MOE_MODES:-quantize,quantize-noexpertsxq} --json "$out/fp8_moe.json" \
      > "$out/fp8_moe.log" 2>&1 || tail -20 "$out/fp8_moe.log"
    sed -n '/^method /,$p' "$out/fp8_moe.log"; }
  [ "${TRACE_S:-100}" != 0 ] && { rm -f /tmp/moetrace_*; timeout $(( $(left) < ${TRACE_S:-100} ? $(left) : ${TRACE_S:-100} )) \
      python3 benchmarks/fp8.py --pair $P --moe-shape qwen3_30b_a3b --work /tmp/moe_shapes --prompts 1 --prompt-len 32 \
      --batches 1 --new 64 --repeats 1 --decode-modes ${TRACE_MODES:-quantize} --trace /tmp/moetrace \
      --json "$out/fp8_moe_trace.json" > "$out/fp8_moe_trace.log" 2>&1 || tail -20 "$out/fp8_moe_trace.log"
    for f in /tmp/moetrace_*_b1.json; do
      echo "== $f"; python3 benchmarks/kernel_timeline.py "$f" --order ${ORDER:-16} \
        --json "$out/kernel_timeline_$(basename "$f")" | tail -${TAIL:-70}
    done; }
  [ "${GPU_TEST_S:-80}" != 0 ] && { timeout $(( $(left) < ${GPU_TEST_S:-80} ? $(left) : ${GPU_TEST_S:-80} )) python3 -m pytest \
    -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "${GPU_TESTS_K:-fp8_routed_expert}" \
    > "$out/gpu_tests.log" 2>&1; tail -4 "$out/gpu_tests.log"; }
  ;;
s37)
  # session 37 (issue 30): the FP8 routed experts with gate's and up's rows stacked in one W8A8 tile and the block
  # scales a K block ahead. OLD_ROOT (a package as `git archive 7185569 specdp_cli benchmarks | tar -x -C .bench/old`
  # makes it) is the code before: one token's experts, its default tile (KERNEL_S), then this tree's default and
  # sweep (--tokens TOKENS); then the Qwen3-30B-A3B shape (8 layers) at batch 1, before (OLD_S, its default) and now
  # (MOE_S; MOE_MODES, benchmarks/fp8.py's; session 37's first call also had -expertsahead and -up32, whose code is
  # not kept), median of 3; then GPU tests (GPU_TEST_S; GPU_TESTS_K)
  end=$((SECONDS + ${LIMIT:-570}))
  old=${OLD_ROOT:-.bench/old}
  [ "${KERNEL_S:-150}" != 0 ] && {
    timeout 60 python3 $old/benchmarks/moe_kernel.py --shapes qwen3_30b_a3b --tokens ${TOKENS:-1,4} --fp8 \
      --all-experts-max-e 0 --json "$out/moe_kernel_old.json" > "$out/moe_kernel_old.log" 2>&1
    grep -E '^qwen3' "$out/moe_kernel_old.log" | grep -v '{' | sed 's/^/old /'
    timeout $(( ${KERNEL_S:-150} - 60 )) python3 benchmarks/moe_kernel.py --shapes qwen3_30b_a3b --tokens ${TOKENS:-1,4} \
      --fp8 --sweep --all-experts-max-e 0 --json "$out/moe_kernel_new.json" > "$out/moe_kernel_new.log" 2>&1
    grep -E '^qwen3' "$out/moe_kernel_new.log" | grep -v '{' | sed 's/^/new /'; }
  moe() {   # ROOT NAME MODES SECONDS
    timeout $(( $(left) < $4 ? $(left) : $4 )) python3 $1/benchmarks/fp8.py --pair $P --moe-shape qwen3_30b_a3b \
      --work /tmp/moe_shapes --prompts 4 --prompt-len 32 --batches 1 --repeats 3 --decode-modes $3 \
      --json "$out/fp8_moe_$2.json" > "$out/fp8_moe_$2.log" 2>&1 || tail -20 "$out/fp8_moe_$2.log"
    sed -n '/^method /,$p' "$out/fp8_moe_$2.log" | sed "s/^/$2 /"; }
  [ "${MOE_S:-220}" != 0 ] && moe . new ${MOE_MODES:-quantize,quantize-noexpertsw8a8t} ${MOE_S:-220}
  [ "${OLD_S:-120}" != 0 ] && moe $old old quantize ${OLD_S:-120}
  [ "${GPU_TEST_S:-60}" != 0 ] && { timeout $(( $(left) < ${GPU_TEST_S:-60} ? $(left) : ${GPU_TEST_S:-60} )) python3 -m pytest \
    -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "${GPU_TESTS_K:-fp8_routed_expert}" \
    > "$out/gpu_tests.log" 2>&1; tail -4 "$out/gpu_tests.log"; }
  ;;
s33link)
  # session 33: the rank's serving loop before (OLD_ROOT: a package as `git archive 8a007fd specdp_cli benchmarks | tar
  # -x -C .bench/old` makes it) and after (this tree), in turn: benchmarks/rank_loop.py (the loop's own µs a step over
  # a stand-in engine), frontend_bench.py with the codepair's METHOD engine (the serving loop's µs a step outside
  # engine steps), then serve_bench.py served against offline (RUNS of METHOD:CLIENT_WORKERS:API_SERVERS)
  old=${OLD_ROOT:-.bench/old}
  for i in 1 2; do for side in old new; do
    root=$([ $side = old ] && echo $old || echo .)
    taskset -c 2,3 timeout 60 python3 benchmarks/rank_loop.py --root $root --runs 3 --seconds 2 \
      --json "$out/rank_loop_${side}_$i.json" 2>&1 | tail -1 | sed "s/^/$side /"
  done; done
  for i in 1 2; do for side in old new; do
    root=$([ $side = old ] && echo $old || echo .)
    timeout 100 python3 $root/benchmarks/frontend_bench.py --tokenizer $P/tokenizer --engine-pair $P \
      --engine-method ${METHOD:-eagle} --client-workers 4 --rank-cpu 3 --json "$out/frontend_${side}_$i.json" > /tmp/fb.log 2>&1
    grep -A1 "streams" /tmp/fb.log | tail -1 | sed "s/^/$side $i /"; grep "^rank:" /tmp/fb.log | sed "s/^/$side $i /"
  done; done
  for run in ${RUNS:-eagle:4:1 eagle:4:2}; do
    IFS=: read m w api <<< "$run"
    timeout 100 python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers $w --api-servers $api \
      --rounds ${ROUNDS:-7} --interleave --rank-cpu 3 --label c$w-api$api --work /tmp/sw33_${m}_${w}_$api \
      --json "$out/serve_${m}_c${w}_api$api.json" > "$out/serve_${m}_c${w}_api$api.log" 2>&1
    tail -4 "$out/serve_${m}_c${w}_api$api.log" | head -1 | sed "s/^/$run /"
  done
  ;;
s30serve)
  # session 30: where the served rank's steps lose against offline (issue 33): serve_bench.py --interleave (codepair,
  # METHODS, ROUNDS rounds) with py-spy sampling every process it starts (--subprocesses, --nonblocking: never paused);
  # collapsed stacks in OUT/pyspy_METHOD.txt (benchmarks/pyspy_steps.py reads them). Needs py-spy's wheel in .whl/.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy .whl/py_spy-*.whl || exit 1
  for m in ${METHODS:-none}; do
    timeout ${SPY_S:-200} /tmp/pyspy/bin/py-spy record --subprocesses --nonblocking --rate ${RATE:-250} --format raw \
      -o "$out/pyspy_$m.txt" -- python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers 4 \
      --rounds ${ROUNDS:-5} --interleave --rank-cpu ${RANK_CPU:-3} --label spy --work /tmp/sw30_$m \
      --json "$out/serve_$m.json" > "$out/serve_$m.log" 2>&1; tail -3 "$out/serve_$m.log"
    python3 benchmarks/pyspy_steps.py "$out/pyspy_$m.txt" --top ${TOP:-150} --json "$out/pyspy_steps_$m.json" \
      > "$out/pyspy_steps_$m.log" 2>&1; head -c 3000 "$out/pyspy_steps_$m.log"
    gzip -9 "$out/pyspy_$m.txt"
  done
  ;;
s30core)
  # session 30: served against offline (codepair, METHODS, ROUNDS interleaved rounds) with the rank's hyperthread
  # siblings left to the frontend and clients (--share-core, as before) and kept free (the new default), in turn
  # (CORES="own": the default alone)
  cat /sys/devices/system/cpu/cpu${RANK_CPU:-3}/topology/thread_siblings_list; lscpu | grep -i "thread\|core\|socket" | head -4
  for i in $(seq ${PAIRS:-1}); do for m in ${METHODS:-none}; do for c in ${CORES:-share own}; do
    timeout ${SERVE_S:-90} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers 4 \
      --rounds ${ROUNDS:-5} --interleave --rank-cpu ${RANK_CPU:-3} $([ $c = share ] && echo --share-core) --label $c \
      --work /tmp/sw30_${m}_$c --json "$out/serve_${m}_${c}_$i.json" > "$out/serve_${m}_${c}_$i.log" 2>&1
    tail -1 "$out/serve_${m}_${c}_$i.log" | sed "s/^/$c $i /"
  done; done; done
  ;;
s31contention)
  # session 31: the offline engine on the rank CPU with 0 / 3 / 6 / 12 other CPUs busy (benchmarks/cpu_contention.py)
  grep -m1 "model name" /proc/cpuinfo
  for m in ${METHODS:-none eagle}; do
    timeout ${CONT_S:-150} python3 benchmarks/cpu_contention.py --pair $P --method $m --cpu ${RANK_CPU:-3} \
      --others ${OTHERS:-0,3,6,12} --kinds ${KINDS:-spin,copy} --rounds ${ROUNDS:-5} --json "$out/contention_$m.json" \
      2> "$out/contention_$m.err" || tail -5 "$out/contention_$m.err"
  done
  ;;
s31threads)
  # session 31: served against offline with the GPU rank's intra-op threads at THREADS (each in turn; both sides
  # get OMP_NUM_THREADS), the rank CPU's time accounted a step (serve_bench's cpu_account)
  for i in $(seq ${PAIRS:-1}); do for m in ${METHODS:-none}; do for t in ${THREADS:-4 1}; do
    timeout ${SERVE_S:-90} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers 4 \
      --rounds ${ROUNDS:-5} --interleave --rank-cpu ${RANK_CPU:-3} --rank-threads $t --label threads$t \
      --work /tmp/sw31_${m}_$t --json "$out/serve_${m}_t${t}_$i.json" > "$out/serve_${m}_t${t}_$i.log" 2>&1
    tail -2 "$out/serve_${m}_t${t}_$i.log" | sed "s/^/t$t $i /"
  done; done; done
  ;;
s41cpu)
  # session 41: does one other CPU slow the rank's CPU 3 (cpu_contention.py --each-cpu, METHOD none)? Then served
  # against offline with that CPU kept free of the server's and the clients' processes (serve_bench.py --keep-free) and
  # not, in turn: RUNS of METHOD:CLIENT_WORKERS:API_SERVERS, PAIRS times. KEEP: the CPU to keep free (default: the
  # sweep's slowest)
  timeout ${SWEEP_S:-150} python3 benchmarks/cpu_contention.py --pair $P --method ${SWEEP_METHOD:-none} --cpu 3 --each-cpu \
    --rounds ${SWEEP_ROUNDS:-3} --json "$out/cpu_each.json" 2>&1 | tee "$out/cpu_each.txt" | tail -20
  keep=${KEEP:-$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if '@' in x['setting']]; print(min(r, key=lambda x: x['x_idle'])['setting'].split('@')[1])" "$out/cpu_each.json")}
  echo "keeping CPU $keep free" | tee -a "$out/summary.txt"
  for i in $(seq ${PAIRS:-1}); do for run in ${RUNS-none:4:2}; do for side in keep share; do
    IFS=: read m w api <<< "$run"
    opt=""; [ $side = keep ] && opt="--keep-free $keep"
    timeout ${SERVE_S:-110} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers $w \
      --api-servers $api --rounds ${ROUNDS:-7} --interleave --rank-cpu 3 $opt --label $side-c$w-api$api \
      --work /tmp/sw41c_${side}_${m}_$i --json "$out/serve_${m}_${side}_$i.json" > /tmp/serve_${m}_${side}_$i.log 2>&1
    tail -4 /tmp/serve_${m}_${side}_$i.log | head -1 | sed "s/^/$i $run $side /" | tee -a "$out/summary.txt"
  done; done; done
  ;;
s42)
  # session 42 (written with no device lent): what the serving rank's loop costs on this host, outside the engine's
  # step (served 0.12-0.15 ms a step in session 41, offline none): a message's send to a reader that sleeps, one that
  # polls and none (link_wake.py: sender on CPU 3, reader on CPU 5); the rank's loop around a step that costs nothing
  # (rank_loop.py, the rank on CPU 3), with requests that never end and in a closed loop of 32-token requests, then
  # that under cProfile (OUT/rank_loop_closed.prof); then RUNS served against offline (as s41, OLD unset)
  taskset -c 3,5 timeout 60 python3 benchmarks/link_wake.py --json "$out/link_wake.json" 2>&1 | tee -a "$out/summary.txt"
  taskset -c 2,3 timeout 60 python3 benchmarks/rank_loop.py --link unix --runs 5 --json "$out/rank_loop_steady.json" \
    2>&1 | tail -1 | tee -a "$out/summary.txt"
  closed="--link unix --max-tokens 32 --prompt 100"
  taskset -c 2,3 timeout 60 python3 benchmarks/rank_loop.py $closed --runs 5 --json "$out/rank_loop_closed.json" 2>&1 \
    | tail -1 | tee -a "$out/summary.txt"
  taskset -c 2,3 timeout 30 python3 benchmarks/rank_loop.py $closed --runs 1 --profile "$out/rank_loop_closed.prof" \
    > /dev/null 2>&1
  for i in $(seq ${PAIRS:-1}); do for run in ${RUNS-}; do
    IFS=: read m w api <<< "$run"
    timeout ${SERVE_S:-110} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers $w \
      --api-servers $api --rounds ${ROUNDS:-7} --interleave --rank-cpu 3 --label c$w-api$api \
      --work /tmp/sw42_${m}_$i --json "$out/serve_${m}_$i.json" > /tmp/serve_${m}_$i.log 2>&1
    tail -4 /tmp/serve_${m}_$i.log | head -1 | sed "s/^/$i $run /" | tee -a "$out/summary.txt"
  done; done
  ;;
s41)
  # session 41: served against offline, this tree and OLD in turn (a package from before, as s40 takes it), RUNS of
  # METHOD:CLIENT_WORKERS:API_SERVERS, PAIRS times; then the 1,500-token shared prefix served (32 new tokens, 2 API
  # servers, caching on and off in turn) for each of PREFIX_METHODS, this tree and (PREFIX_OLD=1) OLD in turn. Logs in
  # /tmp, their last lines in OUT/summary.txt
  root=$PWD
  for i in $(seq ${PAIRS:-1}); do for run in ${RUNS-eagle:4:2}; do for side in new ${OLD:+old}; do
    IFS=: read m w api <<< "$run"
    dir=$root; [ $side = old ] && dir=$root/$OLD
    ( cd $dir && PYTHONPATH=$dir${PYTHONPATH#$root} timeout ${SERVE_S:-110} python3 benchmarks/serve_bench.py \
        --pair $root/$P --methods $m --client-workers $w --api-servers $api --rounds ${ROUNDS:-7} --interleave \
        --rank-cpu 3 --label $side-c$w-api$api --work /tmp/sw41_${side}_${m}_$i \
        --json "$out/serve_${m}_${side}_$i.json" > /tmp/serve_${m}_${side}_$i.log 2>&1 )
    tail -4 /tmp/serve_${m}_${side}_$i.log | head -1 | sed "s/^/$i $run $side /" | tee -a "$out/summary.txt"
  done; done; done
  for i in $(seq ${PAIRS:-1}); do for m in ${PREFIX_METHODS-}; do for side in new ${PREFIX_OLD:+old}; do
    dir=$root; [ $side = old ] && dir=$root/$OLD
    ( cd $dir && PYTHONPATH=$dir${PYTHONPATH#$root} timeout ${PREFIX_S:-110} python3 benchmarks/serve_bench.py \
        --pair $root/$P --methods $m --prefix 1500 --caching on,off --client-workers 4 --api-servers 2 --max-tokens 32 \
        --interleave --rounds ${ROUNDS:-7} --rank-cpu 3 --label prefix-$m-$side --work /tmp/sw41_prefix_${m}_${side}_$i \
        --json "$out/serve_prefix_${m}_${side}_$i.json" > /tmp/serve_prefix_${m}_${side}_$i.log 2>&1 )
    { echo "== prefix $m $side $i"; grep -A2 "^method" /tmp/serve_prefix_${m}_${side}_$i.log; } | tee -a "$out/summary.txt"
  done; done; done
  ;;
s40)
  # session 40: the 1,500-token shared prefix served (draft_model, 32 new tokens, 2 API servers), caching on and off
  # in turn, PAIRS times: this tree, then OLD when set (a package from before: `mkdir OLD; git archive REV specdp_cli
  # benchmarks | tar -x -C OLD`, carried); then served against offline, RUNS of METHOD:CLIENT_WORKERS:API_SERVERS
  root=$PWD
  for i in $(seq ${PAIRS:-1}); do for side in new ${OLD:+old}; do
    dir=$root; [ $side = old ] && dir=$root/$OLD
    ( cd $dir && PYTHONPATH=$dir:/tmp/site timeout ${PREFIX_S:-110} python3 benchmarks/serve_bench.py --pair $root/$P \
        --methods draft_model --prefix 1500 --caching on,off --client-workers 4 --api-servers 2 --max-tokens 32 \
        --interleave --rounds ${ROUNDS:-7} --rank-cpu 3 --label $side --work /tmp/sw40_${side}_$i \
        --json "$out/serve_prefix_${side}_$i.json" > "$out/serve_prefix_${side}_$i.log" 2>&1 )
    echo "== prefix $side $i"; grep -A2 "^method" "$out/serve_prefix_${side}_$i.log"
  done; done
  for run in ${RUNS-eagle:4:2 none:4:2 draft_model:4:2}; do
    IFS=: read m w api <<< "$run"
    timeout ${SERVE_S:-110} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers $w \
      --api-servers $api --rounds ${ROUNDS:-7} --interleave --rank-cpu 3 --label c$w-api$api \
      --work /tmp/sw40_${m}_${w}_$api --json "$out/serve_${m}_c${w}_api$api.json" > "$out/serve_${m}_c${w}_api$api.log" 2>&1
    tail -4 "$out/serve_${m}_c${w}_api$api.log" | head -1 | sed "s/^/$run /"
  done
  ;;
s31serve)
  # session 31: GPU ranks at one intra-op thread (the new default). First the offline engine unpinned with
  # OMP_NUM_THREADS 4 (the old default) and 1; then served against offline, RUNS of METHOD:CLIENT_WORKERS:API_SERVERS
  for spec in ${THREAD_AB:-}; do        # METHOD:CPU (CPU "-": unpinned): rank_threads.py, 4 against 1, interleaved
    IFS=: read m c <<< "$spec"
    timeout 150 python3 benchmarks/rank_threads.py --pair $P --method $m --threads ${AB_THREADS:-4,1} --rounds ${AB_ROUNDS:-7} \
      $([ "$c" != - ] && echo --cpu $c) --json "$out/rank_threads_${m}_$c.json" 2> /tmp/rank_threads_$m.err \
      || tail -5 /tmp/rank_threads_$m.err
  done
  for t in ${UNPINNED-4 1}; do
    OMP_NUM_THREADS=$t timeout 150 python3 benchmarks/offline.py --pair $P --requests 256 --batches 32 --methods none,eagle \
      --repeats 5 --label unpinned-t$t --json "$out/offline_unpinned_t$t.json" > /tmp/unpinned_$t.log 2>&1 \
      || tail -5 /tmp/unpinned_$t.log
    python3 -c "import json,sys; [print('unpinned t$t', r['method'], round(r['tok_s']), 'tok/s, runs', [round(x) for x in r['tok_s_runs']]) for r in json.load(open(sys.argv[1]))['rows']]" "$out/offline_unpinned_t$t.json"
  done
  for run in ${RUNS:-none:4:1 eagle:4:1 draft_model:4:1}; do
    IFS=: read m w api <<< "$run"
    timeout ${SERVE_S:-90} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers $w \
      --api-servers $api --rounds ${ROUNDS:-5} --interleave --rank-cpu ${RANK_CPU:-3} --label c$w-api$api \
      --work /tmp/sw31_${m}_${w}_$api --json "$out/serve_${m}_c${w}_api$api.json" > "$out/serve_${m}_c${w}_api$api.log" 2>&1
    tail -4 "$out/serve_${m}_c${w}_api$api.log" | sed "s/^/$run /"
  done
  ;;
s35loop)
  # session 35: served against offline with the load generator on asyncio's event loop (the default) and on uvloop's
  # (`bench serve --event-loop uvloop`), in turn (RUNS of METHOD:CLIENT_WORKERS:API_SERVERS, PAIRS times)
  for i in $(seq ${PAIRS:-2}); do for run in ${RUNS:-eagle:4:1}; do for L in asyncio uvloop; do
    IFS=: read m w api <<< "$run"
    timeout ${SERVE_S:-100} python3 benchmarks/serve_bench.py --pair $P --methods $m --client-workers $w \
      --api-servers $api --client-event-loop $L --rounds ${ROUNDS:-7} --interleave --rank-cpu ${RANK_CPU:-3} \
      --label c$w-api$api-$L --work /tmp/sw35_${m}_${w}_${api}_$L \
      --json "$out/serve_${m}_c${w}_api${api}_${L}_$i.json" > "$out/serve_${m}_c${w}_api${api}_${L}_$i.log" 2>&1
    tail -4 "$out/serve_${m}_c${w}_api${api}_${L}_$i.log" | head -1 | sed "s/^/$i $run $L /"
  done; done; done
  ;;
dp)
  python3 benchmarks/dp_scaling.py --pair $P --runs "${RUNS:-1:never,1:never,2:never,2:never,2:always}" --work /tmp/dpwork \
    --json "$out/dp_scaling.json" 2>&1 | tail -8
  ;;
esac
