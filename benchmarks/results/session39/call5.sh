. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
OMP_WAIT_POLICY=PASSIVE timeout -s INT 60 python benchmarks/probes/mask_threads.py --calls 1000 > $OUT/mask_threads.log 2>&1; echo rc=$? >> $OUT/mask_threads.log
timeout -s INT 230 python -m pytest -m gpu -v tests/test_gpu.py -k "skeleton_holds or same_gpu_tenant_parity or graph_replays or compiled_generate or calls_that_wait or trains_after_inference_mode" > $OUT/gpu_tests.log 2>&1; echo rc=$? >> $OUT/gpu_tests.log
echo quit | nvidia-cuda-mps-control
