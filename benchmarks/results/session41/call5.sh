. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# the ids checks after review (tied to their calls; --ids-on-host case)
timeout -s INT 230 python -m pytest -m gpu -v tests/test_gpu.py -k "ids_out_of_range or bad_ids" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
# S3 N = 16: does the executor's wake-up stand on the tenants' path? its data loop spinning 200 us (default) against 5 ms before it sleeps
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "spin200=;spin5000=--spin-us 5000" --out $OUT/s3 --tag s41spin > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
