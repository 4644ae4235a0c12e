. benchmarks/gpu_host_setup.sh
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|Flags" | cut -c1-400 > $OUT/cpu.txt
# issue 20: each op of a masked 16- and 64-token bf16 call on this host's CPU (the masking alone took ~200 us here at 16 tokens, ~70 on the 2-core VM)
OMP_WAIT_POLICY=PASSIVE timeout -s INT 120 python3 benchmarks/probes/mask_pieces.py --calls 1000 > $OUT/mask_pieces.log 2>&1; echo rc=$? >> $OUT/mask_pieces.log
OMP_WAIT_POLICY=PASSIVE timeout -s INT 120 python3 benchmarks/probes/mask_threads.py --calls 1000 > $OUT/mask_threads.log 2>&1; echo rc=$? >> $OUT/mask_threads.log
echo quit | nvidia-cuda-mps-control
