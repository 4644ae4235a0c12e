. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# S3 N = 16 at acb3959 (spans the default; the delta as its bytes, one copy of a one-token reply)
cd benchmarks && timeout -s INT 300 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "spans=;calls=--no-layer-spans" --out $OUT/s3 --tag s40 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log; cd ..
tails $OUT/s3 >> $OUT/s3.log
# the GPU tests call 1 did not reach, and the span tests again at the new wire format
timeout -s INT 250 python -m pytest -m gpu -v tests/test_gpu.py -k "skeleton_holds or trains_after_inference_mode or layer_spans" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
echo quit | nvidia-cuda-mps-control
