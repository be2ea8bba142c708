"""Tools that ship with blobha but are not the library: the local cluster, the embedded
ZooKeeper, certificates and the benchmarks."""
