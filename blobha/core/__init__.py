"""Plain values and rules every side shares: errors, keys, digests, ACLs, addresses,
placement, locks and log format. No grpc, protobuf or kazoo is imported here."""
