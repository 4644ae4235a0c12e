. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 50, call 1 (planned in session 49 as planned_next.sh): GPU tests of what session 49 built after its last call:
# what session 49 built after its last device call (~6 min): fused spans in gangs (runner.span_fused,
# kernels/span_norms.py; serve --gang-spans fused, off by default until this passes), the gang test with eager spans,
# fused spans, and fused spans with compiled steps; the step-graph tests with compiled steps (automatic dynamic
# shapes, fail_on_recompile, the tenant's LoRA linears as reductions: _SmallLinears). Then planned_next_s3.sh.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 560 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 240 -rfE --tb=short --durations=0 -s \
  -k "fused_span or gangs or step_graphs_decode" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A30 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached\|CUDAGraph.cpp" | tail -40; } >> $OUT/gpu_tests.txt 2>&1
echo quit | nvidia-cuda-mps-control
