. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# NOT RUN in session 46 (no device time left): the next session's plan, as written then.
# issue 21: S9 N = 16 with S3's adapters (q, k, v, o: --targets, 2026-11-28) hosted / private / 16 processes, then the default q,v
# again with the private fleet (cut in session 46's call 3); each executor runs its hosted fleet first, its private second
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/s9; mkdir -p $d
cd benchmarks
timeout -s INT 300 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --max-processes 16 --seconds 8 --out $d --tag s47qkvo \
  --targets q_proj,k_proj,v_proj,o_proj > $d/s9qkvo.log 2>&1; echo rc=$? >> $d/s9qkvo.log
left=$(( 560 - SECONDS ))
timeout -s INT $left python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --max-processes 0 --seconds 8 --out $d --tag s47qv > $d/s9qv.log 2>&1; echo rc=$? >> $d/s9qv.log
cd ..
for f in $d/s9*.log; do { echo "#### $f"; grep -v "^  \|^Traceback\|^KeyboardInterrupt" $f | tail -14; } >> $OUT/s9.txt; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
