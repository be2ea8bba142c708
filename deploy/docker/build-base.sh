#!/usr/bin/env bash
# Builds the Debian base image for blobha containers with no container registry: debootstrap a
# minimal bookworm root filesystem (python3, a JRE, ZooKeeper, iproute2) and `docker import` it.
# The tag is a hash of this script, so it is built once per machine and rebuilt when the
# package list changes. Prints the image name on the last line of stdout.
#
#   deploy/docker/build-base.sh            # build if missing, print blobha-base:<hash>
#   BLOBHA_DEBIAN_MIRROR=http://... deploy/docker/build-base.sh
set -euo pipefail

suite=bookworm
mirror="${BLOBHA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages="python3,python3-venv,openjdk-17-jre-headless,zookeeper,iproute2,procps,ca-certificates"
hash=$(printf '%s\n%s\n' "$suite $packages" "$(sed -n '/^# build-recipe/,$p' "$0")" \
    | sha256sum | cut -c1-12)
image="blobha-base:$hash"

die() { echo "error: $*" >&2; exit 1; }

command -v docker >/dev/null 2>&1 || die "the docker client is missing: run deploy/docker/ensure-engine.sh"
docker info >/dev/null 2>&1 || die "no Docker engine answers: run deploy/docker/ensure-engine.sh (as root)"

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image"
    exit 0
fi

# build-recipe (changing anything below rebuilds the image)
[ "$(id -u)" = 0 ] || die "debootstrap needs root to build $image"
if ! command -v debootstrap >/dev/null 2>&1; then
    echo "== installing debootstrap" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
        || die "could not install debootstrap from Debian's archive"
fi
work=$(mktemp -d /var/tmp/blobha-rootfs.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "== debootstrap $suite into $work (a minute or two)" >&2
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$work/root" "$mirror" \
        >"$work/debootstrap.log" 2>&1; then
    tail -n 30 "$work/debootstrap.log" >&2
    die "debootstrap failed (mirror $mirror); see the lines above"
fi
# Keep the image small: package caches and docs are not needed at run time.
rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"* \
    "$work/root/usr/share/doc" "$work/root/usr/share/man"
echo "== docker import $image" >&2
tar -C "$work/root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$image" >/dev/null
echo "$image"
