. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 49, call 3: call 2's compiled steps failed (device-side index asserts): the step run before the capture
# advanced the static cache's cumulative_length, so every replay wrote one position further on. Fixed: the run keeps
# the cache's small state tensors. (1) the GPU parity test; (2) S3 N = 16, the processes against tenants whose
# steps are compiled (gangs on); (3) if time is left, a timeline of the compiled fleet alone.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 140 -rfE --tb=short --durations=0 \
  -k "compiled_step_graphs" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
left=$(( 470 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s49c --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured\|CUDAGraph.cpp\|CUDAEvent" $e | tail -8; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
left=$(( 640 - SECONDS ))
if [ $left -gt 150 ]; then
  p=/tmp/r/p; mkdir -p $p
  cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $p \
    --tag s49p --tenant-flags "cgraphs=--step-graphs --compiled-steps" --gpu-profile 16 > $p/s3.log 2>&1; echo rc=$? >> $p/s3.log; cd ..
  grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $p/s3.log | tail -12 > $OUT/s3_profile.txt 2>&1
  cp $p/*timeline.json $OUT/ 2>/dev/null
fi
echo quit | nvidia-cuda-mps-control
