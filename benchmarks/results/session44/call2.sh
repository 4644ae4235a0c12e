. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# (at most 8 files come back: each variant writes one, $OUT/NAME.txt)
watch_dump() { sleep $2; f=$OUT/$1.dump
  e=$(pgrep -f "base_executor.cli serve" | head -1); [ -n "$e" ] && { echo "#### executor"; timeout 30 py-spy dump --native --pid $e; } >> $f 2>&1
  for w in $(pgrep -f fleet_worker.py | head -2); do { echo "#### worker $w"; timeout 30 py-spy dump --native --pid $w; } >> $f 2>&1; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> $f; }
run64() { name=$1; shift; d=/tmp/r/$name; mkdir -p $d; watch_dump $name 80 & wpid=$!
  cd benchmarks && timeout -s INT 130 python3 s3_inference.py --model llama-1b --ns 64 --max-processes 0 --mixed none --seconds 8 --tenants-per-process 4 --out $d --tag s44$name "$@" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
  kill $wpid 2>/dev/null; pkill -f fleet_worker.py; pkill -f "base_executor.cli serve"; sleep 3
  f=$OUT/$name.txt; { echo "#### s3 (flags $*)"; grep -v "^  \|^Traceback\|^KeyboardInterrupt\|^\s*^" $d/s3.log | head -60;
    for e in $d/executor*.log; do echo "#### $e: $(grep -c 'attached;' $e) attached"; grep -v "attached;" $e | tail -25; done
    [ -f $OUT/$name.dump ] && { cat $OUT/$name.dump; rm $OUT/$name.dump; }; } > $f 2>&1; }
# D: every process loads its kernels eagerly (tenants too; connections as default)
CUDA_MODULE_LOADING=EAGER run64 d
# E: no GPU waits anywhere: the executor waits for inputs on the host, tenants for replies
run64 e --serve-args=--no-gpu-waits --tenant-flags "replies=--wait-replies"
# F: the executor as default, tenants wait for replies on the host
run64 f --tenant-flags "replies=--wait-replies"
echo quit | nvidia-cuda-mps-control
