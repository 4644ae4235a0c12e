# Source this on a bare GPU host (the device tool's machines) from the repository root:
#   . benchmarks/gpu_host_setup.sh
# Installs carried wheels (pyzmq, gguf, py-spy: .whl/, see the device README), builds the two
# extensions in place (the tree is used uninstalled: `import symbiont` finds client/, proto/ and
# base_executor/ beside it) and starts CUDA MPS. Stop MPS at the end: `echo quit | nvidia-cuda-mps-control`.
set -e
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
python3 setup.py -q build_ext --inplace -j 4 > /tmp/build_ext.log 2>&1 || { cat /tmp/build_ext.log; false; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d || true
export PYTHONUNBUFFERED=1
set +e
