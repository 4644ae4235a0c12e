. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
cd benchmarks
tails() { for f in $1/executor*.log; do echo "== $f"; grep -v "^  File" $f | grep -v "mailboxes of process\|detached" | tail -5; done; }
TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT 215 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --compile reduce-overhead --tag s37ro --out /tmp/s3r > $OUT/s3r.log 2>&1; echo rc=$? >> $OUT/s3r.log
cp /tmp/s3r/*.json $OUT/ 2>/dev/null; tails /tmp/s3r > $OUT/s3r_executor_tails.log 2>&1
echo quit | nvidia-cuda-mps-control
