. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
cd benchmarks
tails() { for f in $1/executor*.log; do echo "== $f"; grep -v "^  File" $f | grep -v "mailboxes of process\|detached" | tail -5; done; }
TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --compile default --tag s37comp2 --out /tmp/s3c > $OUT/s3c.log 2>&1; echo rc=$? >> $OUT/s3c.log
cp /tmp/s3c/*.json $OUT/ 2>/dev/null; tails /tmp/s3c > $OUT/s3c_executor_tails.log 2>&1
timeout -s INT 220 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --tag s37eager2 --out /tmp/s3e > $OUT/s3e.log 2>&1; echo rc=$? >> $OUT/s3e.log
cp /tmp/s3e/*.json $OUT/ 2>/dev/null; tails /tmp/s3e > $OUT/s3e_executor_tails.log 2>&1
echo quit | nvidia-cuda-mps-control
