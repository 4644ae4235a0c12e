. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# NOT RUN in session 45 (its device time went to the GPU tests): the next session's plan, as written then.
# First, before it: the GPU tests session 45 did not reach or fixed after (trains_after_inference_mode, four_fine and not default).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt; lscpu | grep "Model name" >> $OUT/gpu.txt
# issue 20: masked / plain over loopback gRPC on a GPU host at the current masking (the noise scale as the GEMMs' alpha), twice
for r in 1; do OMP_WAIT_POLICY=PASSIVE timeout -s INT 90 python3 benchmarks/probes/mask_overhead.py --device cuda:0 --tokens 1,16,1024,4096 > /tmp/mask$r.log 2>&1; echo rc=$? >> /tmp/mask$r.log; done
{ for r in 1; do echo "## run $r"; grep -v "Writing model" /tmp/mask$r.log; done; } > $OUT/mask.txt
# issue 19: S3 N = 64 (16 processes of 4, their calls wait for their replies): each thread settling its stream after a forward with the GIL released
# (generate's read of the next token is a pageable copy that holds up the other threads' launches: pytorch/pytorch#143825), CUDA's host waits, the reply's spin; py-spy of the executor and tenant process 0
d=/tmp/r/n64; mkdir -p $d
cd benchmarks && timeout -s INT 420 python3 s3_inference.py --model llama-1b --mixed none --seconds 8 --out $d --tag s45 --ns 64 --max-processes 0 --tenants-per-process 4 --py-spy 64 \
  --tenant-flags "default=;settle=--settle-forward;settleblocking=--settle-forward --cuda-waits blocking;spin20=--spin-us 20" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -30; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of" $e | tail -6; done; } > $OUT/n64.txt 2>&1
(cd $d && tar czf $OUT/n64_pyspy.tgz *pyspy* *.json 2>/dev/null)
echo quit | nvidia-cuda-mps-control
