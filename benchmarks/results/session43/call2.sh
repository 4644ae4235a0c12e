. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name" >> $OUT/gpu.txt
# S3 N = 16: tenants whose decoding steps' full masks go as None (default since e6e6697) / kept (--keep-full-masks), both orders, 16 processes beside them
cd benchmarks && timeout -s INT 540 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --tenant-flags "drop=;keep=--keep-full-masks" --rounds 2 --out $OUT/s3 --tag s43masks > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
