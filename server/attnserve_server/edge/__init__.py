"""The gRPC edge: protobuf <-> domain values, validation, status codes."""
