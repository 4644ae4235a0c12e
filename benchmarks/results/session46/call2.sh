. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt; lscpu | grep "Model name" >> $OUT/gpu.txt
# issue 20, run 2 of 2 (another machine than call 1's): masked / plain over loopback gRPC
OMP_WAIT_POLICY=PASSIVE timeout -s INT 150 python3 benchmarks/probes/mask_overhead.py --device cuda:0 --tokens 1,16,1024,4096 2>&1 | grep -v "Writing model" > $OUT/mask.txt; echo rc=$? >> $OUT/mask.txt
# issue 19 / 21: S3 N = 16 at the current serving code (a joining tenant waits out a sibling deciding): 16 processes, 16 tenants with
# private adapters, 16 tenants with the same adapters hosted by the executor
d=/tmp/r/n16; mkdir -p $d
left=$(( 560 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --hosted --out $d --tag s46 > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of" $e | tail -8; done; } > $OUT/n16.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
