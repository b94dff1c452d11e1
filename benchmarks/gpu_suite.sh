#!/usr/bin/env bash
# Everything this project measures on the GPU machine, in parts that each fit one device call.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR PART...
#
# PART: tests | testsall | crossws | gluonmutants | crossbwd | launches:memory (LAUNCH_TAG) | mlperf:gluon | mlperf:fusedbwd | mlperf:crossbwd | multihot:gluon | multihot:fusedmlp | bandwidth | overlap | overlap:sort | overlap:nccl (2 GPUs) | sweep:carry | sweep:rounding | crosslayer | gemmlayout | fp8dense | mlperf:wgrad | mlperf:eviction | mlperf:adagrad | mlperf:concat | onehot:mlpstream | autotune:gemm | testsall:kernels|first|rest | userpath | userpath:mlperf | loader:mlperf | stream:mlperf | readlate:mlperf | readlate:kaggle | stream:prefetch | stream:prefetch100 | stream:onehot | compile | compilecompare | autopick | combo | mlp | mlp:fp8 | mlp:tail | rows65536 | sweep:launches | mlperf | multihot | multihot:large | stepprofile | stepprofile:hotrows[:kaggle] | stepops | updatefloor | clocks (LAUNCH_TAG) | sweep | kernels | kernels:linear | kernels:graph[:embedding|small|linear] | train | mix | stepgraph | pad | wgrad | terabyte | terabyte:stepgraph | compare[:BATCH] | profile[:VARIANT] (PROFILE_BATCH) | loader | scaling, scaling:mlperf[:N], nccl (2 GPUs). Each part writes its logs, CSVs,
# Markdown and plots under OUT_DIR/results/ (what gets committed to benchmarks/results/) and
# OUT_DIR/logs/, and a failing part does not stop the next one. At the end everything is packed
# into OUT_DIR/suite.tgz (the device tool returns only a few files).
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUT_DIR PART...}
shift
RES="$OUT/results"
LOGS="$OUT/logs"
mkdir -p "$RES" "$LOGS"
# An earlier invocation with the same OUT_DIR packed its results and removed them (below): unpack them first, so
# that this one adds to them (scaling rows appended to the same CSV, say) instead of overwriting the tarball.
[ -f "$OUT/suite.tgz" ] && tar xzf "$OUT/suite.tgz" -C "$OUT"
export PYTHONUNBUFFERED=1

log() { echo "== $(date +%T) $*" | tee -a "$LOGS/suite.log"; }
# SUITE_BUDGET_S (optional): the whole suite's seconds. Each step's limit is cut to what is left,
# and a step that cannot get 30 s is skipped, so the results are always packed before the device
# call's own limit kills everything (a killed call returns nothing packed).
START=$(date +%s)
run() {  # run NAME TIMEOUT_S CMD...: tee output to logs/NAME.log, record the exit status
  local name=$1 limit=$2
  shift 2
  if [ -n "${SUITE_BUDGET_S:-}" ]; then
    local left=$((SUITE_BUDGET_S - ($(date +%s) - START) - 15))
    if [ "$left" -lt 30 ]; then log "skip $name: ${left}s left of SUITE_BUDGET_S"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  log "start $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  log "end $name: exit $rc"
  tail -n 25 "$LOGS/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$LOGS/gpu.txt" 2>&1
python -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" >>"$LOGS/gpu.txt"

# A synthetic dataset with the Criteo Kaggle table sizes, for the comparison runs.
kaggle_data() {
  [ -f /tmp/kaggle-syn/metadata.json ] && return
  run synthetic 240 python -m dlrm.data.synthetic --rows 2000000 --out /tmp/kaggle-syn --cardinalities kaggle \
    --validation-fraction 0.05 --test-fraction 0
}

# The Kaggle model at batch 65536 in bf16 without evaluations (compile mode default): /tmp/kaggle-b65536.json.
kaggle_b65536_config() {
  python - <<'PY'
import json
raw = json.load(open("configs/kaggle.json"))
raw["data"]["batch_size"] = 65536
raw["train"].update({"eval_every": None, "precision": "bf16", "compile": {"mode": "default"}})
json.dump(raw, open("/tmp/kaggle-b65536.json", "w"))
PY
}

# 2.6M synthetic MLPerf DLRM-DCNv2 rows (multi-hot, 214 values a row, full table sizes): ~60 s with every core.
mlperf_data() {
  [ -f /tmp/mlperf-syn/metadata.json ] && return
  run synthetic_mlperf 240 python -m dlrm.data.synthetic --rows 2600000 --out /tmp/mlperf-syn --cardinalities mlperf \
    --multi-hot-sizes mlperf --workers 0
}

# configs/kaggle.json pointed at that dataset, held in GPU memory (the loader is not what is compared).
kaggle_config() {
  python - "$1" <<'EOF'
import json, sys
c = json.load(open("configs/kaggle.json"))
c["data"].update({"path": "/tmp/kaggle-syn", "placement": "gpu"})
c["train"].update({"eval_every": None, "log_every": 10})
json.dump(c, open(sys.argv[1], "w"))
EOF
}

for part in "$@"; do
  case $part in
    scaling)  # configs/kaggle.json, 65536 rows per GPU, on 1 GPU then 2 ranks (a 2-GPU machine);
      # NVLink multicast (NVLS) stays off, as the device machine's README asks; SCALING_PROFILE=1 adds each
      # rank's step profile (results/scaling_kaggle_profile_<N>gpu.{md,csv}); SCALING_ARGS (e.g. "--balance lookups")
      # go to benchmarks/scaling.py as they are, here and in scaling:mlperf
      for n in 1 2; do
        run "scaling_$n" 280 env NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node $n benchmarks/scaling.py \
          --config configs/kaggle.json --batch-per-gpu 65536 --precision tf32 --out "$RES" --name scaling_kaggle \
          ${SCALING_PROFILE:+--profile} ${SCALING_ARGS:-}
      done
      ;;
    scaling:mlperf|scaling:mlperf:*)  # configs/mlperf-dcnv2.json, full tables (bf16 shards on 2 ranks), 65536 rows
      # per GPU: 2 ranks, then 1 GPU of the same machine (results/scaling_mlperf.{md,csv,png}); scaling:mlperf:N runs N only;
      # SCALING_PROFILE=1 adds each rank's step profile (results/scaling_mlperf_profile_<N>gpu.{md,csv})
      counts=${part#scaling:mlperf}
      counts=${counts#:}
      for n in ${counts:-2 1}; do
        run "scaling_mlperf_$n" 240 env NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node $n benchmarks/scaling.py \
          --config configs/mlperf-dcnv2.json --batch-per-gpu 65536 --precision bf16 --warmup 5 --steps 10 --windows 3 \
          --out "$RES" --name scaling_mlperf ${SCALING_PROFILE:+--profile} ${SCALING_ARGS:-}
      done
      ;;
    nccl)  # two GPUs: train.py under torchrun (NCCL, bf16 shards, DCN, multi-hot) against one GPU
      run tests_nccl 300 python -m pytest -q tests/test_distributed_nccl.py -p no:cacheprovider
      ;;
    tests)  # the kernel tests on CUDA (bf16 included), the compile/profile and captured-step tests
      # Most of the time is Triton compiling each test's specializations: 8 processes share the GPU
      # (pytest-xdist, carried as a wheel: .whl/ on the device machine).
      par=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
      run tests_gpu "${TESTS_LIMIT:-300}" python -m pytest -q $par tests/kernels tests/test_compile_profile.py tests/test_graphed_step.py -p no:cacheprovider
      ;;
    kernels:linear)  # the linear family alone, merged into the committed kernels.csv's other rows
      cp benchmarks/results/kernels.csv "$RES/kernels.csv"
      run kernels_linear 140 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels linear --append --out "$RES"
      ;;
    kernels:graph|kernels:graph:*)  # the same kernels timed from CUDA graphs (device time, no host launch
      # cost), as a training step under CUDA graphs runs them: kernels_graph.{csv,md}, <kernel>_graph.png.
      # All of it takes ~11 min on an H100, more than one device call: kernels:graph:embedding,
      # kernels:graph:small and kernels:graph:linear run one chunk each (merged into the same files)
      chunk=${part#kernels:graph}
      chunk=${chunk#:}
      g="--timing graph --rep-ms 50 --batch-sizes 16384,65536 --append"
      [[ -z $chunk || $chunk == embedding ]] && run kernels_graph_embedding 280 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels embedding $g --out "$RES"
      [[ -z $chunk || $chunk == small ]] && run kernels_graph_small 200 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels interaction,loss $g --out "$RES"
      [[ -z $chunk || $chunk == linear ]] && run kernels_graph_linear 200 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels linear $g --out "$RES"
      ;;
    kernels)  # three chunks so one slow family cannot take the others' results with it; the linear
      # kernel autotunes here (DLRM_TRITON_AUTOTUNE=1): the best config per shape, not the default pick
      run kernels_embedding 170 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels embedding --out "$RES"
      run kernels_small 100 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels interaction,loss --append --out "$RES"
      run kernels_linear 140 env DLRM_TRITON_AUTOTUNE=1 python benchmarks/kernels.py --kernels linear --append --out "$RES"
      ;;
    train)  # configs/kaggle.json, fp32/tf32, the issue's three batch sizes
      run train_kaggle 170 python benchmarks/train_throughput.py --config configs/kaggle.json \
        --batch-sizes 65536 --variants eager,compiled-cudagraphs,triton+cudagraphs,triton-embedding+cudagraphs,triton-embedding-interaction+cudagraphs \
        --precisions tf32 --warmup 15 --steps 30 --windows 5 --out "$RES" --name train_throughput_kaggle_b65536
      # small batches are launch-bound: only the CUDA-graph variants can get near their targets
      run train_kaggle_small 140 python benchmarks/train_throughput.py --config configs/kaggle.json \
        --batch-sizes 2048,128 --variants eager,compiled-cudagraphs,triton+cudagraphs,triton-embedding+cudagraphs,triton-embedding-interaction+cudagraphs \
        --precisions tf32 --warmup 15 --steps 50 --windows 5 --out "$RES" --name train_throughput_kaggle_small
      run train_kaggle_bf16 130 python benchmarks/train_throughput.py --config configs/kaggle.json \
        --batch-sizes 65536 --variants eager,compiled,triton+compiled,triton+cudagraphs --precisions bf16 \
        --warmup 15 --steps 30 --windows 5 --out "$RES" --name train_throughput_kaggle_bf16
      ;;
    mix)  # the embedding and interaction in Triton, cuBLAS MLPs (triton-embedding-interaction+cudagraphs)
      # at every size and precision the issue names, Kaggle and Terabyte
      v=triton-embedding-interaction+cudagraphs
      run train_kaggle_mix 150 python benchmarks/train_throughput.py --config configs/kaggle.json \
        --batch-sizes 65536,2048,128 --variants $v --precisions tf32,bf16 \
        --warmup 15 --steps 40 --windows 5 --out "$RES" --name train_throughput_kaggle_mix
      run train_terabyte_mix 100 python benchmarks/train_throughput.py --config configs/terabyte.json \
        --batch-sizes 65536 --variants $v --precisions bf16 \
        --warmup 10 --steps 20 --windows 5 --out "$RES" --name train_throughput_terabyte_mix
      ;;
    stepgraph)  # train.cuda_graph: the whole step (optimizer included) captured as one CUDA graph, at
      # every size the issue names (tf32) and bf16 at 65536
      v=triton-embedding-interaction+step-graph,triton-embedding+step-graph
      run train_kaggle_stepgraph 200 python benchmarks/train_throughput.py --config configs/kaggle.json \
        --batch-sizes 128,2048,65536 --variants $v --precisions tf32 \
        --warmup 15 --steps 40 --windows 5 --out "$RES" --name train_throughput_kaggle_stepgraph
      run train_kaggle_stepgraph_bf16 100 python benchmarks/train_throughput.py --config configs/kaggle.json \
        --batch-sizes 65536 --variants triton-embedding-interaction+step-graph --precisions bf16 \
        --warmup 15 --steps 30 --windows 5 --out "$RES" --name train_throughput_kaggle_stepgraph_bf16
      ;;
    pad)  # the top-MLP input unpadded (model.top_mlp_input_multiple 1) against the configs' 8 (367 -> 368,
      # 479 -> 480; the Triton interaction writes the zero columns), Kaggle and Terabyte, bf16 at 65536
      for c in kaggle terabyte; do
        for m in 1 8; do
          python - "$c" "$m" <<'EOF'
import json, sys
c = json.load(open(f"configs/{sys.argv[1]}.json"))
c["model"]["top_mlp_input_multiple"] = int(sys.argv[2])
json.dump(c, open(f"/tmp/{sys.argv[1]}-pad{sys.argv[2]}.json", "w"))
EOF
          run "train_${c}_pad$m" 150 python benchmarks/train_throughput.py --config "/tmp/$c-pad$m.json" \
            --batch-sizes 65536 --variants triton-embedding-interaction+step-graph --precisions bf16 \
            --warmup 15 --steps 30 --windows 5 --out "$RES" --name "train_throughput_${c}_pad$m"
        done
      done
      ;;
    autopick)  # the variant "auto" (what train.py picks with no kernel/compile/graph setting) next to the named
      # variants it chooses between, same process, at 65536 and 2048 in tf32 and bf16, Kaggle and Terabyte, and
      # Terabyte at its config's 32768 (issue #20: the fastest variant is what "auto" picks; ~7 minutes on an H100)
      e=triton-embedding-interaction+step-graph
      for case in kaggle:tf32:65536:$e,triton-fused-mlp+step-graph kaggle:bf16:65536:$e,triton-wgrad+step-graph \
                  terabyte:bf16:65536:$e,triton-wgrad+step-graph terabyte:bf16:32768:$e,triton-wgrad+step-graph \
                  terabyte:tf32:65536:$e,triton-fused-mlp+step-graph kaggle:bf16:2048:$e kaggle:tf32:2048:$e \
                  terabyte:bf16:2048:$e terabyte:tf32:2048:$e; do
        IFS=: read -r m p b vs <<<"$case"
        run "auto_${m}_${p}_b$b" 130 python benchmarks/train_throughput.py --config "configs/$m.json" --batch-sizes "$b" \
          --variants "auto,$vs" --precisions "$p" --warmup 20 --steps "$([ "$b" -le 2048 ] && echo 200 || echo 30)" \
          --windows 5 --out "$RES" --name "auto_${m}_${p}_b$b"
        grep -o "auto on cuda: .*" "$LOGS/auto_${m}_${p}_b$b.log" | head -1 > "$RES/auto_${m}_${p}_b$b.picks.txt"
      done
      ;;
    combo)  # Inductor's combo kernels (train.compile.combo_kernels) false then true, in pairs: Kaggle tf32 at 128 and 2048,
      # Kaggle bf16 at 128, 2048, 8192, 16384 and 65536, Terabyte bf16 at 32768 and 65536 (results/combo_kernels.md)
      for m in kaggle terabyte; do
        for on in false true; do
          python - "$m" "$on" <<'EOF'
import json, sys
c = json.load(open(f"configs/{sys.argv[1]}.json"))
c["train"]["compile"] = {"enabled": True, "combo_kernels": sys.argv[2] == "true"}
json.dump(c, open(f"/tmp/{sys.argv[1]}-combo-{sys.argv[2]}.json", "w"))
EOF
        done
      done
      for case in kaggle:tf32:128 kaggle:tf32:2048 kaggle:bf16:128 kaggle:bf16:2048 kaggle:bf16:8192 kaggle:bf16:16384 \
                  kaggle:bf16:65536 terabyte:bf16:32768 terabyte:bf16:65536; do
        IFS=: read -r m p b <<<"$case"
        v=$([ "$b" = 65536 ] && echo triton-wgrad+step-graph || echo triton-embedding-interaction+step-graph)
        for on in false true; do
          run "combo_${m}_${p}_b${b}_$on" 90 python benchmarks/train_throughput.py --config "/tmp/$m-combo-$on.json" \
            --batch-sizes "$b" --variants "$v" --precisions "$p" --warmup 20 --steps "$([ "$b" -le 2048 ] && echo 200 || echo 40)" \
            --windows 5 --out "$RES" --name "combo_${m}_${p}_b${b}_$on"
        done
      done
      ;;
    wgrad)  # the weight gradient with the bias sum and ReLU mask fused (kernels/wgrad.py, issue #20): each layer against
      # PyTorch and Inductor, then the step with PyTorch MLPs against the wgrad MLPs, Kaggle and Terabyte, bf16 at 65536
      run wgrad 200 python benchmarks/wgrad.py --out "$RES" --name wgrad
      for c in kaggle terabyte; do
        run "train_${c}_wgrad" 170 python benchmarks/train_throughput.py --config "configs/$c.json" --batch-sizes 65536 \
          --variants triton-embedding-interaction+step-graph,triton-wgrad+step-graph --precisions bf16 \
          --warmup 15 --steps 30 --windows 5 --out "$RES" --name "train_${c}_bf16_wgrad"
      done
      ;;
    terabyte)  # configs/terabyte.json (MLPerf-style, tables capped at 10M rows), bf16 at batch 65536
      run train_terabyte 170 python benchmarks/train_throughput.py --config configs/terabyte.json \
        --batch-sizes 65536 --variants eager,compiled-cudagraphs,triton+cudagraphs,triton-embedding+cudagraphs,triton-embedding-interaction+cudagraphs --precisions bf16 \
        --warmup 10 --steps 20 --windows 5 --out "$RES"
      ;;
    terabyte:stepgraph)  # the same model with the whole-step graph, cuBLAS vs the fused MLP, and its step profile (issue #20)
      run train_terabyte_stepgraph 170 python benchmarks/train_throughput.py --config configs/terabyte.json \
        --batch-sizes 2048,65536 --variants triton-embedding-interaction+step-graph,triton-fused-mlp+step-graph \
        --precisions bf16 --warmup 10 --steps 20 --windows 5 --out "$RES" --name train_throughput_terabyte_stepgraph
      run step_profile_terabyte 120 python benchmarks/step_profile.py --config configs/terabyte.json \
        --variant triton-embedding-interaction+step-graph --precision bf16 --batch-size 65536 --out "$RES" \
        --name step_profile_terabyte_bf16_b65536
      ;;
    compare|compare:*)  # quality and speed of the variants on planted synthetic data with the Kaggle table sizes
      kaggle_data
      kaggle_config /tmp/kaggle-syn.json
      sizes="65536 2048"; [ "$part" != compare ] && sizes=${part#compare:}  # compare:2048 runs one size
      for b in $sizes; do
        steps=$([ "$b" = 65536 ] && echo 30 || echo 300)
        run "compare_$b" 180 python train.py --config /tmp/kaggle-syn.json --batch-size "$b" --max-steps "$steps" \
          --compare "${COMPARE_VARIANTS:-eager,compiled-cudagraphs,triton+cudagraphs,triton-embedding+cudagraphs,triton-embedding-interaction+cudagraphs}" --run-name "compare-kaggle-b$b" --tb-dir "$OUT/tb"
        cp "$OUT/tb/compare-kaggle-b$b/compare.md" "$RES/compare_kaggle_b$b.md" 2>/dev/null
        cp "$OUT/tb/compare-kaggle-b$b/compare.csv" "$RES/compare_kaggle_b$b.csv" 2>/dev/null
        cp "$OUT/tb/compare-kaggle-b$b/compare.png" "$RES/compare_kaggle_b$b.png" 2>/dev/null
      done
      ;;
    compilecompare)  # `train.py --compare eager,compiled` as a user runs it (issue #19: compiled >= 2x eager)
      kaggle_data
      kaggle_config /tmp/kaggle-syn.json
      for b in 8192 65536; do
        ep=$([ "$b" = 8192 ] && echo 2 || echo 5)
        run "compare_compiled_$b" 200 python train.py --config /tmp/kaggle-syn.json --batch-size "$b" --epochs "$ep" \
          --compare eager,compiled --run-name "cmp$b" --tb-dir "$OUT/tb"
        for ext in md csv png; do cp "$OUT/tb/cmp$b/compare.$ext" "$RES/compare_compiled_kaggle_b$b.$ext" 2>/dev/null; done
      done
      ;;
    profile|profile:*)  # one profiled run (eager, or profile:VARIANT, a --compare variant), its timeline
      # and its numbers (.md); PROFILE_BATCH (default 65536) sets the batch size, e.g. 128 to see where
      # a launch-bound small-batch step spends its host time
      variant=${part#profile}
      variant=${variant#:}
      variant=${variant:-eager}
      b=${PROFILE_BATCH:-65536}
      name="kaggle_b$b$([ "$variant" = eager ] || echo "_$variant")"
      kaggle_data
      kaggle_config /tmp/kaggle-syn.json
      python - /tmp/kaggle-syn.json "$variant" "/tmp/profile-$variant.json" <<'EOF'
import json, sys
from dlrm.config import load_config
from dlrm.train.compare import variant_config
json.dump(variant_config(load_config(sys.argv[1]), sys.argv[2]).to_dict(), open(sys.argv[3], "w"))
EOF
      run "profile_$name" 150 python train.py --config "/tmp/profile-$variant.json" --batch-size "$b" --max-steps 20 \
        --profile --run-name "profile-$name" --tb-dir "$OUT/tb"
      python benchmarks/trace_timeline.py "$OUT/tb/profile-$name" --out "$RES/profile_timeline_$name.png" \
        --title "configs/kaggle.json, batch $b, $variant tf32, H100" >>"$LOGS/profile_$name.log" 2>&1
      ;;
    loader)  # preprocessing rows/s (16 workers) and loader samples/s, stream and gpu placement. 8M rows
      # (1M generated, preprocessed 8 times over): an epoch of ~105 batches and 7 shuffle buffers, so
      # decoding the next buffer overlaps cutting the current one, as in a real run (with 1M rows the
      # whole split was one buffer and the 13 batches measured mostly start-up)
      run loader 300 python benchmarks/loader_throughput.py --rows 1000000 --repeat 8 --workers 16 --repeats 3 \
        --reader-threads 4,8,16 --devices cuda --out "$RES" --work /tmp/loader-bench --keep
      # the same 8M-row dataset streamed into training (configs/kaggle.json, whole step one CUDA graph)
      # against the gpu placement: does the stream loader keep the step fed?
      if [ -f /tmp/loader-bench/pp_w16/metadata.json ]; then
        run loader_training_65536 200 python benchmarks/loader_training.py --data /tmp/loader-bench/pp_w16 \
          --batch-size 65536 --steps 300 --out "$RES" --keep-logs
        run loader_training_2048 200 python benchmarks/loader_training.py --data /tmp/loader-bench/pp_w16 \
          --batch-size 2048 --steps 3000 --log-every 100 --out "$RES" --keep-logs
      fi
      ;;
    userpath:mlperf)  # what a user gets with configs/mlperf-dcnv2.json (issue #22): train.py with every default on
      # 2.08M synthetic multi-hot train rows, 13 epochs (403 steps), beside the device-resident step
      # (results/user_path_mlperf.*); USERPATH_PLACEMENTS=stream adds the streamed run (each run writes a 53 GB
      # checkpoint at its end: ~2.5 min a run). The config's own train.log_every (100): until 2026-11-29 this part
      # set 10, whose logging syncs cost ~1% from GPU memory and ~10% streamed (PERF.md, twenty-ninth run)
      mlperf_data
      run user_path_mlperf "${USERPATH_LIMIT:-420}" python benchmarks/user_path.py --config configs/mlperf-dcnv2.json \
        --data /tmp/mlperf-syn --batch-sizes 65536 --epochs 13 --max-steps 403 --placements "${USERPATH_PLACEMENTS:-}" \
        --out "$RES" --name user_path_mlperf
      ;;
    loader:mlperf)  # the stream loader on those multi-hot rows into CUDA, shuffled, by reader threads, pyarrow's column
      # pool on or off (LOADER_ARROW: default,on,off) and, with LOADER_CODECS=lz4,none, copies of the rows in those parquet
      # codecs; and the gpu placement (results/${LOADER_NAME:-loader_throughput_mlperf}.*)
      mlperf_data
      run loader_mlperf "${LOADER_LIMIT:-200}" python benchmarks/loader_throughput.py --dataset /tmp/mlperf-syn --devices cuda \
        --shuffle true --reader-threads "${LOADER_READERS:-4,8,16}" --arrow-threads "${LOADER_ARROW:-default}" \
        ${LOADER_CODECS:+--codecs "$LOADER_CODECS"} --repeats 2 --out "$RES" --name "${LOADER_NAME:-loader_throughput_mlperf}"
      ;;
    stream:mlperf)  # MLPerf DLRM-DCNv2 streamed from LZ4 slot files with the loader timed (benchmarks/stream_timeline.py;
      # PERF.md, twenty-ninth and thirtieth runs): the loader's defaults at train.log_every 100 and 10 beside the same
      # rows in device memory, two runs each as time allows (results/${STREAM_NAME:-stream_defaults_mlperf}.*; the
      # thirtieth run measured the log_every 100 half there and the 10 half in readlate:mlperf)
      [ -f /tmp/mlperf-lz4/metadata.json ] || run synthetic_mlperf_lz4 240 python -m dlrm.data.synthetic --rows 2600000 \
        --out /tmp/mlperf-lz4 --cardinalities mlperf --multi-hot-sizes mlperf --workers 0 --compression lz4
      run stream_mlperf "${STREAM_LIMIT:-500}" python benchmarks/stream_timeline.py --data /tmp/mlperf-lz4 --epochs 13 \
        --repeat 2 --budget-s "${STREAM_BUDGET:-380}" --setting stream100:log_every=100 \
        --setting gpu100:placement=gpu,log_every=100 --setting stream10 --setting gpu10:placement=gpu \
        --machine "$(nproc) CPU cores" --out "$RES" --name "${STREAM_NAME:-stream_defaults_mlperf}"
      ;;
    readlate:mlperf)  # the logging window read one step late (the trainer's default) against at its own step
      # (read_late=0, the trainer before 2026-11-29), MLPerf at log_every 10, from GPU memory and streamed
      # (results/read_late_mlperf.*)
      [ -f /tmp/mlperf-lz4/metadata.json ] || run synthetic_mlperf_lz4 240 python -m dlrm.data.synthetic --rows 2600000 \
        --out /tmp/mlperf-lz4 --cardinalities mlperf --multi-hot-sizes mlperf --workers 0 --compression lz4
      run read_late_mlperf 450 python benchmarks/stream_timeline.py --data /tmp/mlperf-lz4 --epochs 13 --repeat 2 \
        --budget-s 390 --setting gpu10:placement=gpu --setting gpu10sync:placement=gpu,read_late=0 --setting stream10 \
        --setting stream10sync:read_late=0 --machine "$(nproc) CPU cores" --out "$RES" --name read_late_mlperf
      ;;
    stream:prefetch)  # streamed MLPerf at log_every 10 with more decoded buffers ahead (arenas): the loader's stalls at
      # epoch starts and second buffers (PERF.md Next 6, thirtieth run) against its prefetch (results/stream_prefetch_mlperf.*)
      [ -f /tmp/mlperf-lz4/metadata.json ] || run synthetic_mlperf_lz4 240 python -m dlrm.data.synthetic --rows 2600000 \
        --out /tmp/mlperf-lz4 --cardinalities mlperf --multi-hot-sizes mlperf --workers 0 --compression lz4
      run stream_prefetch_mlperf 480 python benchmarks/stream_timeline.py --data /tmp/mlperf-lz4 --epochs 13 --repeat 2 \
        --budget-s 420 --setting pf2:prefetch=2 --setting pf3:prefetch=3 --setting pf4:prefetch=4 \
        --setting gpu10:placement=gpu --machine "$(nproc) CPU cores" --out "$RES" --name stream_prefetch_mlperf
      ;;
    stream:prefetch100)  # prefetch 2 vs 3 (the default since) at the configs' own log_every 100: Kaggle at 65536
      # streamed (one-hot, decode-bound) and MLPerf (results/stream_prefetch_kaggle.*, stream_prefetch_mlperf100.*)
      kaggle_data
      kaggle_b65536_config
      run stream_prefetch_kaggle 240 python benchmarks/stream_timeline.py --config /tmp/kaggle-b65536.json \
        --data /tmp/kaggle-syn --epochs 100 --repeat 2 --budget-s 210 --setting ks100:log_every=100,prefetch=2 \
        --setting ks100pf3:log_every=100,prefetch=3 --machine "$(nproc) CPU cores" --out "$RES" \
        --name stream_prefetch_kaggle
      [ -f /tmp/mlperf-lz4/metadata.json ] || run synthetic_mlperf_lz4 240 python -m dlrm.data.synthetic --rows 2600000 \
        --out /tmp/mlperf-lz4 --cardinalities mlperf --multi-hot-sizes mlperf --workers 0 --compression lz4
      run stream_prefetch_mlperf100 300 python benchmarks/stream_timeline.py --data /tmp/mlperf-lz4 --epochs 13 \
        --repeat 2 --budget-s 270 --setting stream100:log_every=100,prefetch=2 \
        --setting stream100pf3:log_every=100,prefetch=3 --machine "$(nproc) CPU cores" --out "$RES" \
        --name stream_prefetch_mlperf100
      ;;
    stream:onehot)  # one-hot rows streamed at batch 65536 are decode-bound (Kaggle: 4 readers, pyarrow's pool, all
      # busy, 25-29M against 46M from GPU memory; thirty-first run): more readers, with and without the pool
      # (results/stream_onehot_readers_kaggle.*)
      kaggle_data
      kaggle_b65536_config
      run stream_onehot_readers_kaggle 480 python benchmarks/stream_timeline.py --config /tmp/kaggle-b65536.json \
        --data /tmp/kaggle-syn --epochs 100 --repeat 2 --budget-s 440 --setting r4:log_every=100 \
        --setting r8:log_every=100,reader_threads=8 --setting r8solo:log_every=100,reader_threads=8,arrow_threads=0 \
        --setting r16solo:log_every=100,reader_threads=16,arrow_threads=0 --machine "$(nproc) CPU cores" \
        --out "$RES" --name stream_onehot_readers_kaggle
      ;;
    readlate:kaggle)  # the same where a step is short: Kaggle at batch 65536 in bf16 (~1.4 ms a step), log_every 10
      # and 100 from GPU memory; then streamed one-hot rows with the readers at the training thread's priority (the
      # default) and lowered (results/read_late_kaggle*.*, stream_onehot_nice_kaggle.*)
      kaggle_data
      kaggle_b65536_config
      run read_late_kaggle 420 python benchmarks/stream_timeline.py --config /tmp/kaggle-b65536.json \
        --data /tmp/kaggle-syn --epochs 100 --repeat 2 --budget-s 360 --setting k10:placement=gpu \
        --setting k10sync:placement=gpu,read_late=0 --setting k100:placement=gpu,log_every=100 \
        --machine "$(nproc) CPU cores" --out "$RES" --name read_late_kaggle
      run stream_onehot_nice_kaggle 300 python benchmarks/stream_timeline.py --config /tmp/kaggle-b65536.json \
        --data /tmp/kaggle-syn --epochs 100 --repeat 2 --budget-s 240 --setting ks100:log_every=100 \
        --setting ks100nice:log_every=100,reader_nice=10 --machine "$(nproc) CPU cores" --out "$RES" \
        --name stream_onehot_nice_kaggle
      ;;
    userpath)  # what a user gets (issue #19): train.py configs/kaggle.json on the 2M-row Kaggle-shaped
      # synthetic dataset with every default ("auto"), and with placement stream forced, for 6 epochs,
      # beside the device-resident benchmark of the variant auto resolves to
      kaggle_data
      run user_path "${USERPATH_LIMIT:-330}" python benchmarks/user_path.py --data /tmp/kaggle-syn \
        --batch-sizes "${USERPATH_BATCHES:-65536,2048,128}" --epochs 6 --max-steps 1500 --out "$RES"
      ;;
    compile)  # torch.compile on the PyTorch model vs eager, with and without the whole-step graph (issue #19);
      # compiled = mode "auto" (reduce-overhead here), compiled-default = mode default
      run compile_vs_eager 170 python benchmarks/train_throughput.py --config configs/kaggle.json --batch-sizes 8192,65536 \
        --variants eager,compiled,compiled+step-graph --precisions tf32 --warmup 15 --steps 30 --windows 5 \
        --out "$RES" --name compile_vs_eager_kaggle
      run compile_modes 150 python benchmarks/train_throughput.py --config configs/kaggle.json --batch-sizes 8192,65536 \
        --variants eager,compiled,compiled-default --precisions tf32 --warmup 15 --steps 30 --windows 5 \
        --out "$RES" --name compile_auto_kaggle
      ;;
    stepprofile)  # one step's device time by kernel group: MLPerf DLRM-DCNv2 (full tables) and Kaggle tf32 / bf16
      run step_profile_mlperf 110 python benchmarks/step_profile.py --config configs/mlperf-dcnv2.json \
        --variant triton-embedding+step-graph --batch-size 65536 --out "$RES" --name step_profile_mlperf_b65536_bf16cross
      for p in tf32 bf16; do
        run "step_profile_kaggle_$p" 80 python benchmarks/step_profile.py --config configs/kaggle.json \
          --variant triton-embedding-interaction+step-graph --precision $p --batch-size 65536 --out "$RES" \
          --name "step_profile_kaggle_${p}_b65536"
      done
      ;;
    stepprofile:hotrows)  # MLPerf's step (what train.py's "auto" builds) on synthetic uniform batches and on batches of
      # the generator's Zipf-like data, whose hottest row spans ~28k chunks of the update, each with the update's
      # group sums forced on and off (kernels.embedding.update.CARRY_GROUP_SUMS): does the carry walk make train.py's
      # ~9% gap to the benchmark (results/step_profile_hotrows_*)
      [ -f /tmp/mlperf-small/metadata.json ] || run synthetic_mlperf_small 120 python -m dlrm.data.synthetic \
        --rows 600000 --out /tmp/mlperf-small --cardinalities mlperf --multi-hot-sizes mlperf --workers 0 \
        --validation-fraction 0.05 --test-fraction 0
      for gs in on off; do
        run "step_profile_hotrows_uniform_$gs" 150 python benchmarks/step_profile.py --config configs/mlperf-dcnv2.json \
          --variant auto --batch-size 65536 --group-sums $gs --out "$RES" --name "step_profile_hotrows_uniform_$gs"
        run "step_profile_hotrows_zipf_$gs" 150 python benchmarks/step_profile.py --config configs/mlperf-dcnv2.json \
          --variant auto --batch-size 65536 --data /tmp/mlperf-small --group-sums $gs --out "$RES" \
          --name "step_profile_hotrows_zipf_$gs"
      done
      ;;
    stepprofile:hotrows:kaggle)  # the same A/B for the one-hot Kaggle step at batch 65536 in bf16. Its "auto" update
      # is the atomic SGD kernel, which has no walk, so the group sums change nothing there; what the skewed ids cost
      # is that kernel's adds on hot rows (thirty-second run: 1.16 ms uniform, 1.36 on the data's batches;
      # results/step_profile_hotrows_kaggle_*)
      kaggle_data
      kaggle_b65536_config
      for gs in on off; do
        for src in uniform zipf; do
          run "step_profile_hotrows_kaggle_${src}_$gs" 120 python benchmarks/step_profile.py --config /tmp/kaggle-b65536.json \
            --variant auto --batch-size 65536 $([ $src = zipf ] && echo "--data /tmp/kaggle-syn") --group-sums $gs \
            --out "$RES" --name "step_profile_hotrows_kaggle_${src}_$gs"
        done
      done
      ;;
    sweep)  # the pooled fused backward over launch configs and bf16 rounding (issue #22)
      run pooled_update_sweep 200 python benchmarks/pooled_update_sweep.py --dtypes "${SWEEP_DTYPES:-bf16,fp32}" \
        --out "$RES" --name pooled_update_sweep_run
      ;;
    mlp)  # the fused MLP alone (benchmarks/mlp.py) and in the whole Kaggle step (issue #20)
      run mlp 200 python benchmarks/mlp.py --out "$RES"
      run kaggle_fusedmlp 130 python benchmarks/train_throughput.py --config configs/kaggle.json --batch-sizes 2048,65536 \
        --variants triton-embedding-interaction+step-graph,triton-fused-mlp+step-graph --precisions tf32,bf16 \
        --warmup 15 --steps 30 --windows 5 --out "$RES" --name train_throughput_kaggle_fusedmlp
      ;;
    mlp:fp8)  # the FP8 try (kernels/fp8_linear.py, issue #20): bf16 rows with fp8 beside them -> mlp_fp8.*
      mkdir -p "$RES/fp8"
      run mlp_fp8 300 python benchmarks/mlp.py --precisions bf16 --impls eager,compiled,fused,fp8 --out "$RES/fp8"
      for e in md csv png; do cp "$RES/fp8/mlp.$e" "$RES/mlp_fp8.$e" 2>/dev/null; done
      ;;
    mlp:tail)  # the on-chip MLP tail (kernels/mlp_tail.py, issue #20) beside the compiled and fused MLPs -> mlp_tail.*
      mkdir -p "$RES/tail"
      run mlp_tail 400 python benchmarks/mlp.py --impls compiled,fused,tail --out "$RES/tail"
      for e in md csv png; do cp "$RES/tail/mlp.$e" "$RES/mlp_tail.$e" 2>/dev/null; done
      ;;
    rows65536)  # issue #20's three rows at 65536 with what "auto" runs, and the bf16 step profiles (fourth run)
      run rows_kaggle_tf32 110 python benchmarks/train_throughput.py --config configs/kaggle.json --batch-sizes 65536 \
        --variants triton-embedding-interaction+step-graph,triton-fused-mlp+step-graph --precisions tf32 \
        --warmup 10 --steps 20 --windows 5 --out "$RES" --name train_throughput_kaggle_tf32_b65536_final
      for m in kaggle terabyte; do
        run "rows_${m}_bf16" 90 python benchmarks/train_throughput.py --config "configs/$m.json" --batch-sizes 65536 \
          --variants triton-embedding-interaction+step-graph --precisions bf16 --warmup 10 --steps 20 --windows 5 \
          --out "$RES" --name "train_throughput_${m}_bf16_b65536_final"
        run "profile_${m}_bf16" 80 python benchmarks/step_profile.py --config "configs/$m.json" \
          --variant triton-embedding-interaction+step-graph --precision bf16 --batch-size 65536 --out "$RES" \
          --name "step_profile_${m}_bf16_b65536_bf16out"
      done
      ;;
    bandwidth)  # the copy reference by timer, the one-hot lookup's launches, the pooled lookup's (issues #20, #22)
      run copy_bandwidth 90 python benchmarks/copy_bandwidth.py --out "$RES"
      run onehot_embedding_launch 100 python benchmarks/onehot_embedding_sweep.py --launches picked,256x4,32x4 \
        --out "$RES" --name onehot_embedding_launch
      run pooled_lookup_unroll 200 python benchmarks/pooled_embedding.py --dtypes bf16,fp32 --modes fwd --impls triton \
        --batch-sizes 65536,16384 --lookup-launches 32x4x1,32x4x2,64x4x2,128x4x1,128x4x2 --out "$RES/pooled_lookup"
      ;;
    autotune:gemm)  # Kaggle bf16 at 65536: mode default vs GEMM autotuning alone, first start and second (issue #20)
      for v in triton-embedding-interaction+step-graph triton-embedding-interaction+autotune-gemm+step-graph; do
        rm -rf "/tmp/ind_${v%%+step-graph}" "/tmp/tri_${v%%+step-graph}"  # the first start on empty caches
        for start in first second; do
          TORCHINDUCTOR_CACHE_DIR="/tmp/ind_${v%%+step-graph}" TRITON_CACHE_DIR="/tmp/tri_${v%%+step-graph}" \
            run "autotune_gemm_${v}_$start" 240 python benchmarks/train_throughput.py --config configs/kaggle.json \
            --variants "$v" --precisions bf16 --batch-sizes 65536 --out "$RES" --name "autotune_gemm_${v}_$start"
        done
      done
      ;;
    sweep:launches)  # the pooled bf16 update's launch configs with the shipped rounding bits (issue #22)
      run pooled_update_sweep_launches 200 python benchmarks/pooled_update_sweep.py --dtypes bf16 --roundings hash1hi \
        --out "$RES" --name pooled_update_sweep_hash1hi_launches
      ;;
    mlperf)  # MLPerf DLRM-DCNv2, full tables in bf16: the plain PyTorch version vs ours as "auto" runs it (twice), then
      # the pooled embedding's bandwidth (issue #22); each loads 52 GB of tables, one model at a time
      run mlperf_dcnv2 340 python benchmarks/mlperf_dcnv2.py --batch-sizes 65536 --variants auto,auto --out "$RES"
      run pooled_embedding 160 python benchmarks/pooled_embedding.py --out "$RES"
      ;;
    overlap)  # a second stream beside the GEMMs: the embedding's update, sort and lookup against the step's GEMMs,
      # alone, in series and on two streams (MLPerf shapes, full bf16 tables)
      run stream_overlap 200 python benchmarks/stream_overlap.py --out "$RES"
      ;;
    overlap:sort)  # one GPU: the update's sort beside the lookup (this step's) and beside an update given its sort
      # (the next step's sort under this step's update), against the sort beside the forward GEMMs (issue #22)
      run stream_overlap_sort 200 python benchmarks/stream_overlap.py \
        --pairs "sort||update_presorted,sort||lookup,sort||fwd_gemms" --out "$RES/stream_overlap_sort"
      ;;
    sweep:rounding)  # the pooled bf16 update at the picked launch: stochastic-rounding bits x row-load orders x L2
      # priorities, two interleaved repeats (issue #22; the last such sweep ran at an older launch)
      run pooled_update_sweep_rounding 300 python benchmarks/pooled_update_sweep.py --dtypes bf16 --launches picked \
        --roundings "${ROUND_RNGS:-hash1,hash1hi}" --row-loads "${ROUND_LOADS:-prefetch_l2,first,with_gradients}" \
        --evictions "${ROUND_EVICTIONS:-grad_last}" --repeats 2 --out "$RES" \
        --name "${ROUND_NAME:-pooled_update_sweep_rounding}"
      ;;
    overlap:nccl)  # the two-rank step's collectives (the embeddings' all_to_all, DDP's all_reduce) beside the
      # embedding's sort, lookup and update and the weight-gradient GEMMs, on two GPUs (MLPerf shapes, full bf16 tables
      # on each): what a step could hide behind its exchange (results/stream_overlap_nccl.*)
      run stream_overlap_nccl 280 env NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 \
        benchmarks/stream_overlap.py --pairs "a2a||sort,a2a||wgrads,a2a||lookup,allreduce||update" \
        --out "$RES/stream_overlap_nccl"
      ;;
    sweep:carry)  # the pooled bf16 update with the carry kernel's blocks of chunks and carry launches (issue #22);
      # CARRY_LAUNCHES, CARRY_CHUNKS and CARRY_NAME change what is swept and where it is written
      run pooled_update_sweep_carry 240 python benchmarks/pooled_update_sweep.py --dtypes bf16 \
        --launches "${CARRY_LAUNCHES:-picked,16:32:1:4,16:128:1:4,16:64:1:1,16:64:1:2,16:64:1:8}" \
        --carry-chunks "${CARRY_CHUNKS:-8,32,128}" --repeats 2 --out "$RES" \
        --name "${CARRY_NAME:-pooled_update_sweep_carry}"
      ;;
    crosslayer)  # the DCNv2 cross network: Inductor's vs the Triton path, and the fused forward's tiles
      run cross_layer 250 python benchmarks/cross_layer.py --out "$RES"
      ;;
    mlperf:adagrad)  # the dense Adagrad as one Triton pass (adagrad.ONE_PASS) against torch's foreach ops: the MLPerf
      # step alternating in one process (results/adagrad_one_pass.md)
      run mlperf_dcnv2_adagrad 220 python - "$RES" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
import dlrm.train.adagrad as adagrad
import mlperf_dcnv2
for i, one_pass in enumerate([True, False, True, False]):
    adagrad.ONE_PASS = one_pass
    print("ONE_PASS", one_pass, flush=True)
    mlperf_dcnv2.main(["--no-baseline", "--batch-sizes", "65536", "--variants", "triton-embedding+step-graph",
                       "--out", f"{sys.argv[1]}/adagrad_{i}_{'one_pass' if one_pass else 'foreach'}"])
EOF
      ;;
    mlperf:maxnreg)  # the update's chunk kernel at its launch's register cap (SparseUpdateConfig.chunk_maxnreg, 128 for
      # MLPerf's bf16 tables) against uncapped (update.CHUNK_MAXNREG = 0): the MLPerf step ("auto") alternating in one
      # process (results/mlperf_dcnv2_maxnreg*)
      run mlperf_dcnv2_maxnreg 300 python - "$RES" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
from kernels.embedding import update
import mlperf_dcnv2
for i, cap in enumerate([None, 0, None, 0]):
    update.CHUNK_MAXNREG = cap
    print("CHUNK_MAXNREG", cap, flush=True)
    mlperf_dcnv2.main(["--no-baseline", "--batch-sizes", "65536", "--variants", "auto",
                       "--out", f"{sys.argv[1]}/maxnreg_{i}_{'launch' if cap is None else 'none'}"])
EOF
      ;;
    mlperf:mlpstream)  # the fused MLP's weight-gradient GEMMs on a side stream against in series (shipped for 16-bit operands)
      # (kernels.mlp.SIDE_STREAM): the MLPerf step ("auto") alternating in one process (results/mlperf_dcnv2_mlpstream*)
      run mlperf_dcnv2_mlpstream 300 python - "$RES" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
import kernels.mlp
import mlperf_dcnv2
for i, side in enumerate([True, False, True, False]):
    kernels.mlp.SIDE_STREAM = side
    print("SIDE_STREAM", side, flush=True)
    mlperf_dcnv2.main(["--no-baseline", "--batch-sizes", "65536", "--variants", "auto",
                       "--out", f"{sys.argv[1]}/mlpstream_{i}_{'side' if side else 'serial'}"])
EOF
      ;;
    onehot:mlpstream)  # the same A/B for the one-hot models whose "auto" runs the fused MLP (tf32 at 65536): Kaggle and
      # Terabyte, side stream (shipped for 32-bit operands) against in series, alternating in one process (results/mlpstream_h200_b.md)
      run onehot_mlpstream 300 python - "$RES" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
import kernels.mlp
import train_throughput
for model in ("kaggle", "terabyte"):
    for i, side in enumerate([True, False, True, False]):
        kernels.mlp.SIDE_STREAM = side
        print(model, "SIDE_STREAM", side, flush=True)
        train_throughput.main(["--config", f"configs/{model}.json", "--batch-sizes", "65536", "--variants", "auto",
                               "--precisions", "tf32", "--warmup", "10", "--steps", "30", "--windows", "5",
                               "--out", sys.argv[1], "--name", f"onehot_mlpstream_{model}_{i}_{'side' if side else 'serial'}"])
EOF
      ;;
    mlperf:concat)  # the DCN input built by the pooled lookup (dlrm.model.dlrm.CONCAT_IN_LOOKUP) against a separate
      # concatenation: the MLPerf step alternating in one process (results/mlperf_dcnv2_concat.md)
      run mlperf_dcnv2_concat 220 python - "$RES" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
import dlrm.model.dlrm as dlrm_model
import mlperf_dcnv2
for i, on in enumerate([True, False, True, False]):
    dlrm_model.CONCAT_IN_LOOKUP = on
    print("CONCAT_IN_LOOKUP", on, flush=True)
    mlperf_dcnv2.main(["--no-baseline", "--batch-sizes", "65536", "--variants", "triton-embedding+step-graph",
                       "--out", f"{sys.argv[1]}/concat_{i}_{'lookup' if on else 'separate'}"])
EOF
      ;;
    stepops)  # every kernel of MLPerf's step by its launching op (shapes, strides), each GEMM timed alone on that layout
      run step_ops_mlperf 200 python benchmarks/step_ops.py --config configs/mlperf-dcnv2.json --out "$RES" \
        --name "step_ops_mlperf${LAUNCH_TAG:+_$LAUNCH_TAG}"
      ;;
    updatefloor)  # the pooled update's traffic without its arithmetic, beside the update (thirty-fourth run: 2.04-2.59
      # ms against 3.25 on an H200; results/update_traffic_floor_h200.md)
      run update_traffic_floor 200 python benchmarks/update_traffic_floor.py --out "$RES" --repeats 2 \
        --skeleton-launches 32:1,16:2 --name "update_traffic_floor${LAUNCH_TAG:+_$LAUNCH_TAG}"
      ;;
    clocks)  # the SM clock, power and clock-limit reasons through 20 s of MLPerf's step, 20 s of one GEMM and 20 s each
      # of CLOCK_KERNELS (default a copy and the Gluon cross forward: DRAM traffic alone, math and traffic at once)
      # (thirty-third run: an H200 at its 700 W cap 99% of the step, 1635 MHz median, results/step_clocks_mlperf.md;
      # thirty-sixth: the cross forward capped at 1470-1485 MHz, a copy at 1980, results/step_clocks_cross_fwd_pty_h200.md)
      run step_clocks_mlperf 360 python benchmarks/step_clocks.py --config configs/mlperf-dcnv2.json --seconds 20 \
        --kernels "${CLOCK_KERNELS-copy,cross_fwd}" --out "$RES" --name "step_clocks_mlperf${LAUNCH_TAG:+_$LAUNCH_TAG}"
      ;;
    gemmlayout)  # every GEMM of the MLPerf step in eight operand layouts, and as rowwise / tensorwise FP8 GEMMs
      run gemm_layout_probe 150 python benchmarks/gemm_layout_probe.py --out "$RES"
      ;;
    fp8dense)  # the MLPerf dense part (cross network + top MLP) with rowwise FP8 GEMMs against bf16, and errors
      run fp8_dense_probe 300 python benchmarks/fp8_dense_probe.py --out "$RES"
      ;;
    crossws)  # the warp-specialized Gluon cross-layer forward (kernels/cross_ws.py) against cuBLAS + Inductor's pass
      run cross_ws_probe 300 python benchmarks/cross_ws_probe.py --out "$RES"
      ;;
    gluonmutants)  # the Gluon cross kernels' mutants against their GPU tests (results/gluon_mutants_h200.md)
      run gluon_mutants 580 python benchmarks/gluon_mutants.py --out "$RES/gluon_mutants"
      ;;
    mlperf:gluon)  # MLPerf DLRM-DCNv2: "auto" (the Gluon cross layers on Hopper) against the PyTorch cross net,
      # alternating in one process, beside the plain PyTorch version (results/mlperf_dcnv2_gluon.md)
      v=auto,triton-embedding+step-graph
      run mlperf_dcnv2_gluon 420 python benchmarks/mlperf_dcnv2.py --batch-sizes 65536 --variants "$v,$v" \
        --out "$RES/mlperf_gluon"
      ;;
    mlperf:fusedbwd|mlperf:crossbwd)  # MLPerf DLRM-DCNv2, "auto": the cross network's backward (kernels.cross_ws_net.BACKWARD)
      # as the fused GEMM epilogues ("fused_gemm", mlperf:fusedbwd) or the default's GEMMs + Triton passes ("passes",
      # mlperf:crossbwd) against the per-layer ops ("layers"; CROSSBWD_AGAINST names another), alternating in one process
      mode=fused_gemm; [ "$part" = mlperf:crossbwd ] && mode=passes
      against=${CROSSBWD_AGAINST:-layers}
      run "mlperf_dcnv2_${part#mlperf:}_vs_$against" 420 python - "$RES" "$mode" "$against" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
from kernels import cross_ws_net
import mlperf_dcnv2
for i, mode in enumerate([sys.argv[2], sys.argv[3], sys.argv[2], sys.argv[3]]):
    cross_ws_net.BACKWARD = mode
    print("BACKWARD", mode, flush=True)
    mlperf_dcnv2.main(["--no-baseline", "--batch-sizes", "65536", "--variants", "auto",
                       "--out", f"{sys.argv[1]}/crossbwd_{i}_{mode}"])
EOF
      ;;
    launches:memory)  # the memory-bound kernels tuned on an H100, over launches on this GPU (issue #22; an H200 moves
      # ~1.4x the H100's bytes with as many SMs): the cross backward's passes, the fused MLP's mask kernel, the Gluon
      # cross forward's configs
      run cross_bwd_passes_launches 200 python benchmarks/cross_bwd_passes.py --out "$RES" --name "cross_bwd_passes_${LAUNCH_TAG:-gpu}" \
        --launches 64x128r512w8,64x128r1024w8,128x128r512w8,64x128r256w8,32x128r512w4,64x128r512w4,128x64r512w8,64x64r512w4,64x128r2048w8,32x128r1024w4
      run mask_bias_launches 150 python benchmarks/mask_bias_launches.py --out "$RES" --name "mask_bias_launches_${LAUNCH_TAG:-gpu}"
      run cross_ws_probe_fwd 240 python benchmarks/cross_ws_probe.py --no-backward --out "$RES/cross_ws_probe_${LAUNCH_TAG:-gpu}"
      ;;
    crossbwd)  # the cross network backward's Triton passes (kernels/cross_bwd_passes.py) against Inductor's, launches
      run cross_bwd_passes 200 python benchmarks/cross_bwd_passes.py --out "$RES"
      ;;
    multihot:gluon)  # planted multi-hot quality (as "multihot"): eager, the PyTorch cross net and the Gluon one
      [ -f /tmp/mh-small/metadata.json ] || run synthetic_mh 120 python -m dlrm.data.synthetic --rows 600000 \
        --out /tmp/mh-small --cardinalities small --multi-hot-sizes mlperf --validation-fraction 0.1 --test-fraction 0
      python - <<'PY'
import json
c = json.load(open("configs/mlperf-dcnv2.json"))
c["model"]["embedding_dtype"] = "fp32"
c["data"]["batch_size"] = 4096
c["optim"]["schedule"] = {"warmup_steps": 50}
c["train"].update({"eval_every": None, "log_every": 20})
json.dump(c, open("/tmp/mh-quality.json", "w"))
PY
      run compare_multihot_gluon 300 python train.py --config /tmp/mh-quality.json --data /tmp/mh-small --epochs 2 \
        --run-name mh-quality-gluon --tb-dir "$OUT/tb" \
        --compare eager,triton-embedding+step-graph,triton-embedding-gluon-cross+step-graph
      cp "$OUT/tb/mh-quality-gluon/compare.md" "$RES/compare_multihot_dcn_b4096_gluon.md" 2>/dev/null
      cp "$OUT/tb/mh-quality-gluon/compare.csv" "$RES/compare_multihot_dcn_b4096_gluon.csv" 2>/dev/null
      ;;
    multihot:fusedmlp)  # planted multi-hot quality (as "multihot:gluon"): eager, the Gluon cross layers with the
      # "passes" backward and PyTorch MLPs, and the same with the fused MLP (what "auto" runs at 65536 on Hopper)
      [ -f /tmp/mh-small/metadata.json ] || run synthetic_mh 120 python -m dlrm.data.synthetic --rows 600000 \
        --out /tmp/mh-small --cardinalities small --multi-hot-sizes mlperf --validation-fraction 0.1 --test-fraction 0
      python - <<'PY'
import json
c = json.load(open("configs/mlperf-dcnv2.json"))
c["model"]["embedding_dtype"] = "fp32"
c["data"]["batch_size"] = 4096
c["optim"]["schedule"] = {"warmup_steps": 50}
c["train"].update({"eval_every": None, "log_every": 20})
json.dump(c, open("/tmp/mh-quality.json", "w"))
PY
      run compare_multihot_fusedmlp 360 python train.py --config /tmp/mh-quality.json --data /tmp/mh-small --epochs 2 \
        --run-name mh-quality-fusedmlp --tb-dir "$OUT/tb" \
        --compare eager,triton-embedding-gluon-cross+step-graph,triton-embedding-gluon-cross-fused-mlp+step-graph
      cp "$OUT/tb/mh-quality-fusedmlp/compare.md" "$RES/compare_multihot_dcn_b4096_fusedmlp.md" 2>/dev/null
      cp "$OUT/tb/mh-quality-fusedmlp/compare.csv" "$RES/compare_multihot_dcn_b4096_fusedmlp.csv" 2>/dev/null
      ;;
    mlperf:wgrad)  # MLPerf DLRM-DCNv2: the wgrad MLPs against PyTorch MLPs, alternating (results/mlperf_dcnv2_wgrad.md)
      v=triton-embedding-wgrad+step-graph,triton-embedding+step-graph
      run mlperf_dcnv2_wgrad 200 python benchmarks/mlperf_dcnv2.py --no-baseline --batch-sizes 65536 \
        --variants "$v,$v" --out "$RES/mlperf_wgrad"
      ;;
    mlperf:eviction)  # the pooled update's L2 priorities (update.EVICTION): the MLPerf step with "grad_last" and
      # "none", alternating, one process; then the update alone over every setting (results/mlperf_dcnv2_eviction.md)
      run mlperf_dcnv2_eviction 220 python - "$RES" <<'EOF'
import sys
sys.path.append("benchmarks")  # appended: benchmarks/kernels.py must not shadow the kernels package
from kernels.embedding import update
import mlperf_dcnv2
for i, ev in enumerate(["grad_last", "none", "grad_last", "none"]):
    update.EVICTION = ev
    print("EVICTION", ev, flush=True)
    mlperf_dcnv2.main(["--no-baseline", "--batch-sizes", "65536", "--variants", "triton-embedding+step-graph",
                       "--out", f"{sys.argv[1]}/eviction_{i}_{ev}"])
EOF
      run pooled_update_sweep_eviction 200 python benchmarks/pooled_update_sweep.py --out "$RES" \
        --name pooled_update_sweep_eviction --dtypes bf16 --launches picked \
        --evictions none,rows_first,grad_last,rows_first_grad_last --repeats 3
      ;;
    multihot)  # quality on planted multi-hot data: the MLPerf model's shapes with fp32 tables on small-table
      # data with MLPerf's multi-hot sizes, eager vs the Triton embedding, against the oracle AUC
      [ -f /tmp/mh-small/metadata.json ] || run synthetic_mh 120 python -m dlrm.data.synthetic --rows 600000 \
        --out /tmp/mh-small --cardinalities small --multi-hot-sizes mlperf --validation-fraction 0.1 --test-fraction 0
      python - <<'PY'
import json
c = json.load(open("configs/mlperf-dcnv2.json"))
c["model"]["embedding_dtype"] = "fp32"
c["data"]["batch_size"] = 4096
c["optim"]["schedule"] = {"warmup_steps": 50}
c["train"].update({"eval_every": None, "log_every": 20})
json.dump(c, open("/tmp/mh-quality.json", "w"))
PY
      run compare_multihot 240 python train.py --config /tmp/mh-quality.json --data /tmp/mh-small --epochs 2 \
        --run-name mh-quality --tb-dir "$OUT/tb" --compare eager,triton-embedding+compiled
      cp "$OUT/tb/mh-quality/compare.md" "$RES/compare_multihot_dcn_b4096.md" 2>/dev/null
      cp "$OUT/tb/mh-quality/compare.csv" "$RES/compare_multihot_dcn_b4096.csv" 2>/dev/null
      ;;
    multihot:large)  # the oracle gap as results/multihot_quality.md measures it: 12M fresh planted rows (16
      # generator processes), one epoch of the same model, what "auto" picks (no kernel flag)
      [ -f /tmp/mh-12m/metadata.json ] || run synthetic_mh_12m 300 python -m dlrm.data.synthetic --rows 12000000 \
        --out /tmp/mh-12m --cardinalities small --multi-hot-sizes mlperf --validation-fraction 0.1 --test-fraction 0 \
        --workers 0
      python - <<'PY'
import json
c = json.load(open("configs/mlperf-dcnv2.json"))
c["model"]["embedding_dtype"] = "fp32"
c["data"]["batch_size"] = 4096
c["optim"]["schedule"] = {"warmup_steps": 50}
c["train"].update({"eval_every": 660, "log_every": 100})
json.dump(c, open("/tmp/mh-quality-12m.json", "w"))
PY
      run quality_mh_12m 280 python train.py --config /tmp/mh-quality-12m.json --data /tmp/mh-12m --epochs 1 \
        --run-name mh-quality-12m --tb-dir "$OUT/tb"
      cp "$OUT/tb/mh-quality-12m/summary.json" "$RES/multihot_quality_12m_summary.json" 2>/dev/null
      ;;
    testsall)  # the whole suite as `pytest -q` runs it, on the GPU machine (gpu-marked tests included)
      run tests_all "${TESTS_LIMIT:-400}" python -m pytest -q -p no:cacheprovider ${TESTS_ARGS:-}
      ;;
    testsall:kernels|testsall:first|testsall:rest)  # the same suite in three parts, one a device call: with
      # pytest-xdist on 16 cores the whole suite needs more than 10 minutes (results/gpu_tests_2026-11-24.md:
      # tests/kernels ~2 min, the first 21 other test files ~6.5 min, the rest ~6 min)
      par=$(python -c "import xdist" 2>/dev/null && echo "-n ${TESTS_WORKERS:-16}")
      files=$(ls tests/test_*.py)
      case $part in
        # with the docstring examples of dlrm/ and kernels/ (testpaths: a plain `pytest -q` runs them too)
        testsall:kernels) sel="tests/kernels dlrm kernels" ;;
        testsall:first) sel=$(echo "$files" | head -21) ;;
        *) sel=$(echo "$files" | tail -n +22) ;;
      esac
      run "tests_${part#testsall:}" "${TESTS_LIMIT:-560}" python -m pytest -v -p no:cacheprovider -p no:benchmark -rfE \
        --durations=15 $par $sel
      ;;
    *)
      log "unknown part $part"
      ;;
  esac
done
# checkpoints of the Kaggle-sized model are 2 GB each (compare runs write one per variant)
[ -d "$OUT/tb" ] && find "$OUT/tb" -type d -name checkpoints -prune -exec rm -rf {} +
# The device tool returns at most 8 files of 16 MiB: one tarball, profiler traces left out (the
# timeline PNG above is drawn from them), loose files removed.
tar czf "$OUT/suite.tgz" -C "$OUT" --exclude='*.pt.trace.json*' --exclude=checkpoints results logs $([ -d "$OUT/tb" ] && echo tb)
log "packed $(du -h "$OUT/suite.tgz" | cut -f1)"
cp "$LOGS/suite.log" "$OUT/suite.log"
rm -rf "$RES" "$LOGS" "$OUT/tb"
