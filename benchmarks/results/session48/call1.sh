. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# Session 48, call 1: planned at the end of session 47.
# (1) the GPU tests the last changes of session 47 touched (9f40c61: a definition waits for a round with no GPU wait
# to warm its tenant's stream; the release loops), with the stalled-tenant tests beside them; (2) S3 at N = 4, 8, 16
# with step graphs only (where does the shared GPU saturate?) and a GPU timeline of 16 step-graphed tenants and
# the executor (fleet_timeline: what the GPU runs while each token takes 29.5 ms against 6.2 alone)
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 90 -rfE --tb=short --durations=0 \
  -k "step_graphs or stalled or killed_while_the_gpu_waits" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
left=$(( 570 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 4,8,16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s48 --tenant-flags "graphs=--step-graphs" --gpu-profile 16 > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -60; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
