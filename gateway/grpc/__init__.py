"""The public gRPC surface, `hetero.v1.Inference`: each RPC checked, run on the generation path
every API shares, and ended with its status set (`hetero_common.grpc_server.end_call`).
"""
