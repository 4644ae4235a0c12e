. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
(which ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu) >> $OUT/gpu.txt 2>&1
OMP_WAIT_POLICY=PASSIVE timeout -s ABRT 150 python3 benchmarks/probes/mask_overhead.py --device cuda:0 > /tmp/mask.log 2>&1; echo rc=$? >> /tmp/mask.log
cp /tmp/mask.log $OUT/
timeout -s ABRT 200 python3 benchmarks/probes/merge_switch.py --paths kernel --repeat 5 --tiles 32x256x32/4/3,32x256x64/4/3/g4,32x256x64/4/3/g8,32x256x64/4/3/g16,64x256x64/8/3/g4,16x256x64/4/3/g8,32x128x64/4/3/g8,64x128x64/4/3/g8 --out $OUT/merge_switch.json > /tmp/merge.log 2>&1; echo rc=$? >> /tmp/merge.log
cp /tmp/merge.log $OUT/
echo quit | nvidia-cuda-mps-control; sleep 1
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout -s ABRT 200 $NCU --set full -k regex:merge_kernel -c 4 -o /tmp/mergeprof python3 benchmarks/probes/merge_switch.py --model llama-1b --paths kernel --repeat 1 --tiles 32x256x64/4/3/g8 > /tmp/ncu_run.log 2>&1; echo rc=$? >> /tmp/ncu_run.log
  tail -30 /tmp/ncu_run.log > $OUT/ncu_run_tail.log
  $NCU -i /tmp/mergeprof.ncu-rep --page details > /tmp/ncu_details.txt 2>&1; gzip -c /tmp/ncu_details.txt > $OUT/ncu_details.txt.gz
fi
