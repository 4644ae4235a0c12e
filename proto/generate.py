"""Regenerates proto/executor_pb2.py from proto/executor.proto.

The committed file was generated with grpcio-tools 1.75.1 (protobuf gencode 6.31.1),
which runs on any protobuf runtime >= 6.31.1. Run from the repository root:

    pip install grpcio-tools==1.75.1 && python proto/generate.py
"""
import pathlib
import sys

from grpc_tools import protoc

HERE = pathlib.Path(__file__).resolve().parent

if __name__ == "__main__":
    rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={HERE}", str(HERE / "executor.proto")])
    sys.exit(rc)
