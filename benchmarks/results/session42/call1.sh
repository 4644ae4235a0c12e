. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
# the ids GPU tests at 369fd39's refactor (not run on a GPU since)
timeout -s INT 200 python -m pytest -m gpu -v tests/test_gpu.py -k "ids_out_of_range or bad_ids" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
# where tenant 0's and process 0's main thread wait at N = 16 with the executor's 5 ms spin (py-spy, 250 Hz; call 4 of session 41 was before it)
cd benchmarks && timeout -s INT 340 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "spin5000=" --py-spy 16 --out $OUT/s3 --tag s42spy > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
