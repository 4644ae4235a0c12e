. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# Session 48, call 5 (the last ~260 s of device time): the GPU tests of gangs and step graphs after the review's fixes
# (88f2e28 and after: lane streams shared and tracked, tables on a setup stream, slot reuse, stall detection).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 190 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short --durations=0 -s \
  -k "gangs or step_graphs_decode" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A30 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached\|CUDAGraph.cpp" | tail -60; } >> $OUT/gpu_tests.txt 2>&1
echo quit | nvidia-cuda-mps-control
