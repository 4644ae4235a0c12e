. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# NOT RUN in session 46 (no device time left): issue 19, S3 N = 64 (16 processes of 4 tenants, which wait for their replies) as it is,
# and with each tenant thread settling its stream after a forward with the GIL released (hypothesis: generate's pageable read of
# the next token holds up the other threads' launches, pytorch/pytorch#143825); then S9 at N = 64 the same way (hosted / private)
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
d=/tmp/r/n64; mkdir -p $d
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --mixed none --seconds 8 --out $d --tag s47 --ns 64 --max-processes 0 --tenants-per-process 4 \
  --tenant-flags "default=;settle=--settle-forward" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log
left=$(( 560 - SECONDS ))
timeout -s INT $left python3 s9_hosted.py --model llama-1b --ns 64 --max-processes 0 --tenants-per-process 4 --registered 100 --seconds 8 --out $d --tag s47n64 > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log; cd ..
for f in $d/s3.log $d/s9.log; do { echo "#### $f"; grep -v "^  \|^Traceback\|^KeyboardInterrupt" $f | tail -14; } >> $OUT/n64.txt; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
