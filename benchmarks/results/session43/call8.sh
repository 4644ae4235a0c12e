. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# S3 at N = 64: MPS takes 48 processes a GPU, so 16 processes of 4 tenants each (fleet_worker --tenants 4)
cd benchmarks && timeout -s INT 200 python3 s3_inference.py --model llama-1b --ns 64 --max-processes 0 --mixed none --seconds 8 --tenants-per-process 4 --out $OUT/s3n64 --tag s43n64 > $OUT/s3n64.log 2>&1; echo rc=$? >> $OUT/s3n64.log; cd ..
tails $OUT/s3n64 >> $OUT/s3n64.log
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $OUT/gpu.txt
# beside it: N = 16, one tenant a process, and 16 processes
cd benchmarks && timeout -s INT 150 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $OUT/s3n16 --tag s43n16 > $OUT/s3n16.log 2>&1; echo rc=$? >> $OUT/s3n16.log; cd ..
tails $OUT/s3n16 >> $OUT/s3n16.log
echo quit | nvidia-cuda-mps-control
