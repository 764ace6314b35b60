"""`serve --edge-processes N`: gRPC edges in N processes in front of one engine process."""
