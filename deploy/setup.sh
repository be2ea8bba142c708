#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian/Ubuntu machine: Java and ZooKeeper from the distribution
# (the embedded ZooKeeper of 'blobha local-cluster' and of the tests), then a virtualenv in
# .venv with blobha and its server extra installed. Usage: deploy/setup.sh [EXTRAS], e.g.
# deploy/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
compgen -G "/usr/share/java/zookeeper*.jar" >/dev/null || compgen -G "/usr/share/zookeeper/zookeeper*.jar" >/dev/null \
    || need_apt+=(zookeeper)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
        echo "setup: please install: ${need_apt[*]} (apt-get install -y ...)" >&2
        exit 1
    fi
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    echo "setup: installing ${need_apt[*]}" >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The masters' own dependencies (the server extra) always: this checkout runs masters.
spec=".[server${extras:+,$extras}]"
# strict editable mode lays out blobha.leader / blobha.sync as a real package tree, which both
# the interpreter and mypy can follow.
.venv/bin/python -m pip install -q -e "$spec" --config-settings editable_mode=strict
