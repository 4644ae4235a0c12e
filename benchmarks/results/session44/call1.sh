. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# watcher: at $2 s into a run, py-spy dumps of the executor and two tenant processes, and the GPU's utilisation
watch_dump() { sleep $2; d=$OUT/$1-dump; mkdir -p $d
  e=$(pgrep -f "base_executor.cli serve" | head -1); [ -n "$e" ] && timeout 30 py-spy dump --native --pid $e > $d/executor.txt 2>&1
  for w in $(pgrep -f fleet_worker.py | head -2); do timeout 30 py-spy dump --native --pid $w > $d/worker-$w.txt 2>&1; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > $d/smi.txt; }
# A: N = 64 as 16 processes of 4, as in session 43 (stalled after 52 attaches)
run64() { name=$1; shift; watch_dump $name 75 & wpid=$!
  cd benchmarks && timeout -s INT 120 python3 s3_inference.py --model llama-1b --ns 64 --max-processes 0 --mixed none --seconds 8 --tenants-per-process 4 --out $OUT/$name --tag s44$name "$@" > $OUT/$name.log 2>&1; echo rc=$? >> $OUT/$name.log; cd ..
  kill $wpid 2>/dev/null; pkill -f fleet_worker.py; pkill -f "base_executor.cli serve"; sleep 3
  tails $OUT/$name >> $OUT/$name.log; grep -c attached $OUT/$name/executor*.log >> $OUT/$name.log; }
run64 a
# B: every process with eager kernel loading and 32 hardware queues (tenant processes too)
CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 run64 b
# C: the executor waits for inputs on the host
run64 c --serve-args=--no-gpu-waits
echo quit | nvidia-cuda-mps-control
