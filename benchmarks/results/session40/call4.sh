. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# S3 N = 16 (no processes: device time left for two executors only): does the executor wait for a core behind 16 busy tenants? the same spans executor at nice 0 and nice -10
cd benchmarks && timeout -s INT 280 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --executors "spans=;spans-nice=--nice -10" --out $OUT/s3 --tag s40c > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
