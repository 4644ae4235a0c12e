. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
# first GPU run of hosted adapters inside layer spans (cb02003) and spans inside torch.compile graphs (at 741b814)
timeout -s INT 290 python -m pytest -m gpu -v tests/test_hosted_adapters.py tests/test_gpu.py -k "a_same_gpu_tenant_with_a_hosted or merged_and_paged or compiled_generate or layer_spans" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
# S9: hosted adapters (now in spans) against the same tenants holding them
cd benchmarks && timeout -s INT 250 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --max-processes 0 --seconds 8 --out $OUT/s9 --tag s41 > $OUT/s9.log 2>&1; echo rc=$? >> $OUT/s9.log; cd ..
tails $OUT/s9 >> $OUT/s9.log
echo quit | nvidia-cuda-mps-control
