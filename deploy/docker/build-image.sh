#!/usr/bin/env bash
# Builds the blobha image with no network during `docker build`: wheels of the project and its
# dependencies are prepared on the host (pip download/wheel, for the image's Python), then
# copied in. The tag is blobha:<hash of the sources and the base>, so an unchanged tree is built
# once; `blobha:latest` points at the newest build. Prints the image name on the last line.
#
#   deploy/docker/build-image.sh                          # on the local Debian base (offline)
#   deploy/docker/build-image.sh --base python:3.11-slim  # on a public Python image
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

die() { echo "error: $*" >&2; exit 1; }

base=""
while [ $# -gt 0 ]; do
    case "$1" in
        --base) base="${2:?--base needs an image name}"; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

command -v docker >/dev/null 2>&1 || die "the docker client is missing: run deploy/docker/ensure-engine.sh"
docker info >/dev/null 2>&1 || die "no Docker engine answers: run deploy/docker/ensure-engine.sh (as root)"
if [ -z "$base" ]; then
    base=$(bash deploy/docker/build-base.sh | tail -n 1)
fi
docker image inspect "$base" >/dev/null 2>&1 \
    || die "base image $base is not present and no registry can be reached; build it with deploy/docker/build-base.sh"

# What goes into the image: the package sources, the build files and the base's identity.
base_id=$(docker image inspect --format '{{.Id}}' "$base")
hash=$( (echo "$base_id"; cd "$root" && find pyproject.toml blobha leader sync deploy/Dockerfile \
        deploy/docker/zk-run.sh deploy/config/master.toml -type f \
        -not -path '*/__pycache__/*' -not -name '*.pyc' -print0 \
        | sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-12)
image="blobha:$hash"
if docker image inspect "$image" >/dev/null 2>&1; then
    docker tag "$image" blobha:latest
    echo "$image"
    exit 0
fi

# The image's Python decides which binary wheels fit.
pyver=$(docker run --rm --entrypoint python3 "$base" -c \
    'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")') \
    || die "the base image $base has no working python3"
python=${PYTHON:-python3}
ctx=$(mktemp -d /var/tmp/blobha-image.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
mkdir "$ctx/wheels"
echo "== building the blobha wheel" >&2
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$ctx/wheels" "$root" >&2 \
    || die "pip wheel of the project failed (is the 'build'/'setuptools' backend installable?)"
echo "== fetching dependency wheels for CPython $pyver (pip cache or the package index)" >&2
"$python" -m pip download --quiet --dest "$ctx/wheels" --only-binary=:all: \
    --python-version "$pyver" --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "$(echo "$ctx"/wheels/blobha-*.whl)[server]" >&2 \
    || die "could not download the dependency wheels for CPython $pyver"
cp deploy/Dockerfile deploy/docker/zk-run.sh deploy/config/master.toml "$ctx/"
echo "== docker build $image (base $base)" >&2
docker build --quiet --build-arg BASE="$base" --label org.blobha.image=master \
    -t "$image" "$ctx" >&2 || die "docker build failed; see the lines above"
docker tag "$image" blobha:latest
echo "$image"
