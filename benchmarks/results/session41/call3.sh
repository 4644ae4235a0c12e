. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# S3 N = 16 with every forward compiled: tenants now make one span call a layer inside their graphs (first GPU run), 16 compiled processes beside them
cd benchmarks && TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT 560 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --compile default --out $OUT/s3 --tag s41comp > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
