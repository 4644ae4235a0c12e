. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# S3 again on another machine: the new default (the data loop spins 5 ms) against 200 us, N = 1 and 16, processes beside them
cd benchmarks && timeout -s INT 420 python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 16 --mixed none --seconds 8 --executors "spin5000=;spin200=--spin-us 200" --out $OUT/s3 --tag s41spin2 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
