#!/usr/bin/env bash
# the multi-hot oracle gap of gpu_suite.sh multihot:large with the DCN model's MLP init
# as it is now (TorchRec's nn.Linear) and as it was (the 2019 DLRM's normal init, reinit_mlp_ a no-op), same data.
set -u
OUT=$1
[ -f .whl/gpu-env.sh ] && source .whl/gpu-env.sh >/dev/null 2>&1  # the GPU machine's carried wheels
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
s=$(date +%s)
timeout 300 python -m dlrm.data.synthetic --rows 12000000 --out /tmp/mh-12m --cardinalities small \
  --multi-hot-sizes mlperf --validation-fraction 0.1 --test-fraction 0 --workers 0 > "$OUT/gen.log" 2>&1
echo "gen exit $? in $(( $(date +%s) - s )) s" | tee -a "$OUT/times.txt"
python - <<'PY'
import json
c = json.load(open("configs/mlperf-dcnv2.json"))
c["model"]["embedding_dtype"] = "fp32"
c["data"]["batch_size"] = 4096
c["optim"]["schedule"] = {"warmup_steps": 50}
c["train"].update({"eval_every": 660, "log_every": 100})
json.dump(c, open("/tmp/mh-quality-12m.json", "w"))
PY
s=$(date +%s)
timeout 200 python train.py --config /tmp/mh-quality-12m.json --data /tmp/mh-12m --epochs 1 --run-name new-init \
  --tb-dir /tmp/tb > "$OUT/new_init.log" 2>&1
echo "new-init exit $? in $(( $(date +%s) - s )) s" | tee -a "$OUT/times.txt"
cp /tmp/tb/new-init/summary.json "$OUT/new_init_summary.json"
s=$(date +%s)
timeout 200 python - > "$OUT/old_init.log" 2>&1 <<'PY'
import runpy, sys
import dlrm.model.archs as archs
archs.reinit_mlp_ = lambda mlp, init: None  # the MLPs keep init_linear_ (the 2019 DLRM's), as before 4e432df
sys.argv = ["train.py", "--config", "/tmp/mh-quality-12m.json", "--data", "/tmp/mh-12m", "--epochs", "1",
            "--run-name", "old-init", "--tb-dir", "/tmp/tb"]
runpy.run_path("train.py", run_name="__main__")
PY
echo "old-init exit $? in $(( $(date +%s) - s )) s" | tee -a "$OUT/times.txt"
cp /tmp/tb/old-init/summary.json "$OUT/old_init_summary.json"
grep -h "validation: AUC\|samples/s" "$OUT/new_init.log" "$OUT/old_init.log" | tail -12
