. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 120 python3 -m pytest -m gpu -q -o faulthandler_timeout=60 tests/test_atmm.py -k "merge" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
tail -8 /tmp/gputests.log > $OUT/gputests_tail.log
timeout -s ABRT 90 python3 benchmarks/probes/merge_switch.py --paths kernel --repeat 9 --tiles 64x128x64/4/3/g4,64x256x64/8/3/g4 --out $OUT/merge_switch.json > /tmp/merge.log 2>&1; echo rc=$? >> /tmp/merge.log
cp /tmp/merge.log $OUT/
OMP_WAIT_POLICY=PASSIVE timeout -s ABRT 110 python3 benchmarks/probes/mask_overhead.py --device cuda:0 --alone > /tmp/mask.log 2>&1; echo rc=$? >> /tmp/mask.log
cp /tmp/mask.log $OUT/
echo quit | nvidia-cuda-mps-control
