. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# NOT RUN in session 45 (no device time left): S9 at N = 64 as 16 processes of 4 tenants, hosted against private
# adapters (100 registered, Zipf 1.0); 64 processes do not start under MPS. Then N = 16 one a process beside it.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
d=/tmp/r/s9; mkdir -p $d
cd benchmarks && timeout -s INT 420 python3 s9_hosted.py --model llama-1b --ns 64 --max-processes 0 --tenants-per-process 4 --registered 100 --seconds 8 --out $d --tag s45n64 > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s9.log | tail -20; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of" $e | tail -6; done; } > $OUT/s9n64.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
