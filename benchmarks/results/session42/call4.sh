. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -5 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# S3 N = 16: tenants' CUDA waits spinning (auto) / sleeping (blocking), against an executor whose loop spins 5 ms (default) and one under SCHED_FIFO spinning 200 us (--realtime-loop)
cd benchmarks && timeout -s INT 380 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --tenant-waits auto,blocking --executors "spin5000=;rt200=--realtime-loop --spin-us 200" --out $OUT/s3 --tag s42rt > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
# S4 again (call 3: the mixed fleet's decoding ITL 0.95x the 8 decoding tenants')
cd benchmarks && timeout -s INT 170 python3 s4_mixed.py --model llama-1b --seconds 8 --out $OUT/s4 --tag s42b > $OUT/s4.log 2>&1; echo rc=$? >> $OUT/s4.log; cd ..
tails $OUT/s4 >> $OUT/s4.log
echo quit | nvidia-cuda-mps-control
