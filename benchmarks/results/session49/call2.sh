. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 49, call 2: step graphs captured from the compiled forward (step_graphs="compiled").
# Call 1's timeline: 16 step-graphed tenants and 16 processes both ran ~610k kernels/s (1,190 and 1,226 launches a
# token); each tenant launches ~1,000 kernels a token of its own. (1) the GPU parity test; (2) S3 N = 16, the
# processes against tenants whose steps are compiled (gangs on); (3) a timeline of the compiled fleet alone.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 180 -rfE --tb=short --durations=0 -s \
  -k "compiled_step_graphs" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
left=$(( 560 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s49b --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning" $d/s3.log | tail -30; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured\|CUDAGraph.cpp" $e | tail -8; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
left=$(( 585 - SECONDS ))
if [ $left -gt 120 ]; then
  p=/tmp/r/p; mkdir -p $p
  cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $p \
    --tag s49p --tenant-flags "cgraphs=--step-graphs --compiled-steps" --gpu-profile 16 > $p/s3.log 2>&1; echo rc=$? >> $p/s3.log; cd ..
  grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning" $p/s3.log | tail -12 > $OUT/s3_profile.txt 2>&1
  cp $p/*timeline.json $OUT/ 2>/dev/null
fi
echo quit | nvidia-cuda-mps-control
