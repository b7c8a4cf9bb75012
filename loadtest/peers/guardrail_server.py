"""Guardrail checker in Python: `grpcio`, with stubs generated from the contract itself.

    python guardrail_server.py PROTO_ROOT PORT

Generates `portcullis/guardrail/v1/guardrail_pb2*.py` from PROTO_ROOT (the repository's
`proto/` folder) with grpcio-tools into a temporary folder, then serves the Guardrail service
and the gRPC health service on 127.0.0.1:PORT. Its rule: the tool `get-sum` only with
`a == 1`; every other check is allowed. Prints "ready" once it listens.
"""

import importlib
import json
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_tools import protoc

CONTRACT = "portcullis/guardrail/v1/guardrail.proto"


def generate(proto_root: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="guardrail-stubs-"))
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            CONTRACT,
        ]
    )
    if status != 0:
        sys.exit(f"protoc failed on {proto_root}/{CONTRACT}")
    return out


def main() -> None:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    proto_root, port = sys.argv[1], int(sys.argv[2])
    sys.path.insert(0, str(generate(proto_root)))
    pb = importlib.import_module("portcullis.guardrail.v1.guardrail_pb2")
    pb_grpc = importlib.import_module("portcullis.guardrail.v1.guardrail_pb2_grpc")

    def allow():
        return pb.Verdict(allow=pb.Allow())

    class Checker(pb_grpc.GuardrailServicer):
        def CheckMcpRequest(self, request, context):
            arguments = json.loads(request.arguments_json)
            if request.name == "get-sum" and arguments.get("a") != 1:
                reason = f"python checker: get-sum needs a == 1, not {arguments.get('a')}"
                return pb.Verdict(deny=pb.Deny(reason=reason))
            return allow()

        def CheckMcpResponse(self, request, context):
            return allow()

        def CheckLlmRequest(self, request, context):
            return allow()

        def CheckLlmResponse(self, request, context):
            return allow()

        def CheckA2aMessage(self, request, context):
            return allow()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GuardrailServicer_to_server(Checker(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
