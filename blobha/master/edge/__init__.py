"""How a master is reached: the gRPC servicer, gatekeeper, interceptor, audit log, health
service, Prometheus metrics and the HTTP status page."""
