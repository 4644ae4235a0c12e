. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# the embedding ids looked up clamped on the GPU (tests first), compiled generate after the _hooked fix
timeout -s INT 270 python -m pytest -m gpu -v tests/test_gpu.py -k "ids_out_of_range or bad_ids or compiled_generate" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
# S3 N = 16: ids looked up on the GPU (default) against checked on the executor's host, 16 processes beside them
cd benchmarks && timeout -s INT 300 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "gpu-ids=;host-ids=--ids-on-host" --out $OUT/s3 --tag s41 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
