#!/bin/bash
# Runs one ZooKeeper node from Debian's zookeeper package, configured the way the official
# `zookeeper` image is: ZOO_MY_ID and ZOO_SERVERS ("server.1=zk1:2888:3888;2181 ..."), plus
# ZOO_TICK_TIME and ZOO_MAX_SESSION_TIMEOUT. Data in /data, transaction log in /datalog.
set -euo pipefail
: "${ZOO_MY_ID:?set ZOO_MY_ID to the number of this node}"
: "${ZOO_SERVERS:?set ZOO_SERVERS, e.g. server.1=zk1:2888:3888;2181 server.2=...}"
tick="${ZOO_TICK_TIME:-2000}"
cat >/conf/zoo.cfg <<CFG
tickTime=$tick
initLimit=${ZOO_INIT_LIMIT:-10}
syncLimit=${ZOO_SYNC_LIMIT:-5}
dataDir=/data
dataLogDir=/datalog
clientPort=2181
maxSessionTimeout=${ZOO_MAX_SESSION_TIMEOUT:-$((tick * 20))}
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr,mntr,stat
quorumListenOnAllIPs=true
CFG
for server in $ZOO_SERVERS; do
    echo "$server" >>/conf/zoo.cfg
done
echo "$ZOO_MY_ID" >/data/myid
if [ ! -f /usr/share/java/zookeeper.jar ]; then
    echo "zk-run: this image has no ZooKeeper (build it on the Debian base from build-base.sh)" >&2
    exit 1
fi
# /usr/share/java holds several SLF4J bindings (nop among them); naming slf4j-simple first makes
# ZooKeeper log to stderr, where `docker logs` shows it, instead of nowhere.
exec java -Xmx"${ZOO_HEAP:-256m}" -Dorg.slf4j.simpleLogger.defaultLogLevel="${ZOO_LOG_LEVEL:-warn}" \
    -cp "/usr/share/java/slf4j-simple.jar:/usr/share/java/*:/usr/share/zookeeper/*" \
    org.apache.zookeeper.server.quorum.QuorumPeerMain /conf/zoo.cfg
