"""ZooKeeper: the layout and its codecs, the connection handler and the lock-down ACLs."""
