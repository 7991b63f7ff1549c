"""What every service shares: errors, gRPC server setup, logging, metrics, the Redis registry."""
