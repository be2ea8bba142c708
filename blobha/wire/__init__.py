"""The protocol: protobuf <-> values, chunk framing, the data channel's client end and framing,
call credentials and TLS."""
