. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do echo "== $f"; grep -v "^  File" $f | grep -v "mailboxes of process" | tail -8; done; }
cd benchmarks
timeout -s INT 300 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "spans=;calls=--no-layer-spans" --tag s39b --out /tmp/s3 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log
cp /tmp/s3/*.json $OUT/ 2>/dev/null; tails /tmp/s3 > $OUT/s3_executor_tails.log 2>&1
cd ..
timeout -s INT 250 python -m pytest -m gpu -v tests/test_gpu.py -k "cuda_executor or same_gpu_tenant_parity or calls_that_wait or graph_replays or two_placements or compiled_generate or peer_gpu_tenant_parity or skeleton_holds" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
echo quit | nvidia-cuda-mps-control
