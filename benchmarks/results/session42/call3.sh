. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# S3 N = 16 on 16 cores: 16 tenants + the executor's spinning loop are 17 busy threads. Do tenants that yield or sleep in their CUDA waits (the mask's .all(), the stop check) leave the others more CPU?
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --tenant-waits auto,yield,blocking --out $OUT/s3 --tag s42waits > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
# S4 at the current serving code (layer spans, 5 ms spin): 6 decoding + 2 fine-tuning tenants against 8 decoding tenants
cd benchmarks && timeout -s INT 200 python3 s4_mixed.py --model llama-1b --seconds 8 --out $OUT/s4 --tag s42 > $OUT/s4.log 2>&1; echo rc=$? >> $OUT/s4.log; cd ..
tails $OUT/s4 >> $OUT/s4.log
echo quit | nvidia-cuda-mps-control
