#!/usr/bin/env bash
# Makes sure a Docker engine answers on /var/run/docker.sock. On a fresh machine this installs
# Debian's docker.io (as root) and starts dockerd in the background, then waits for the socket.
# Idempotent: does nothing when an engine already answers.
set -euo pipefail

engine_up() { docker info >/dev/null 2>&1; }

if engine_up; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "error: no Docker engine is running and this is not root; start dockerd first" >&2
    exit 1
fi
if ! command -v dockerd >/dev/null 2>&1; then
    echo "== installing docker.io"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null
fi
if ! command -v docker >/dev/null 2>&1; then
    echo "error: dockerd is installed but the docker client is missing" >&2
    exit 1
fi
log=/var/log/blobha-dockerd.log
echo "== starting dockerd (log: $log)"
# setsid: the engine outlives this script and the CI step that started it.
setsid nohup dockerd >"$log" 2>&1 </dev/null &
deadline=$((SECONDS + 90))
until engine_up; do
    if [ $SECONDS -ge $deadline ]; then
        echo "error: dockerd did not answer within 90 s; last lines of $log:" >&2
        tail -n 20 "$log" >&2 || true
        exit 1
    fi
    sleep 0.5
done
echo "== Docker engine ready: $(docker version --format '{{.Server.Version}}')"
