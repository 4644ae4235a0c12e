. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -5 "$f"; }; done; }
# spans on by default (c3ba91e): the GPU tests never run with them on
timeout -s INT 330 python -m pytest -m gpu -v tests/test_gpu.py -k "layer_spans or skeleton_holds or compiled_generate or trains_after_inference_mode or graph_replays_equal_eager_calls and not tiny-llama" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
# where a lone S3 process's and tenant's ~30 ms a token go (S1's loop takes 12-14)
cd benchmarks && timeout -s INT 150 python3 s3_inference.py --model llama-1b --ns 1 --max-processes 1 --mixed none --seconds 8 --py-spy 1 --out $OUT/s3 --tag s40spy > $OUT/s3_spy.log 2>&1; echo rc=$? >> $OUT/s3_spy.log; cd ..
tails $OUT/s3 >> $OUT/s3_spy.log
OMP_WAIT_POLICY=PASSIVE timeout -s INT 60 python benchmarks/probes/mask_threads.py --calls 1000 > $OUT/mask_threads.log 2>&1; echo rc=$? >> $OUT/mask_threads.log
echo quit | nvidia-cuda-mps-control
