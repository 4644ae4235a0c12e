. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# where tenant 0's and process 0's main thread wait at N = 16, now that the embedding call takes the native lane (py-spy, 250 Hz)
cd benchmarks && timeout -s INT 420 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "spans=" --py-spy 16 --out $OUT/s3 --tag s41spy > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
