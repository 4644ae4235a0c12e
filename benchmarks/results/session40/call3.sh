. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# S3 N = 1 and 16: spans (default) / per-unit calls / processes, py-spy of tenant 0, process 0 and the executor at N = 16
cd benchmarks && timeout -s INT 540 python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 16 --mixed none --seconds 8 --executors "spans=;calls=--no-layer-spans" --py-spy 16 --out $OUT/s3 --tag s40b > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
