"""kvhint.v1 messages (kvhint_pb2) and gRPC stubs (kvhint_pb2_grpc). Generated; do not edit."""
