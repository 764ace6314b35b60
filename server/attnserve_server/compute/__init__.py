"""Compute: torch on a device. Knows nothing of gRPC or queues."""
