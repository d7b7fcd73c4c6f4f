#!/bin/sh
# Run as root in the image build (k8s/image/Containerfile): install what the base image lacks, with its own apt.
# Both bases are Debian-family: the debootstrap rootfs (Debian) and Ray's images (Ubuntu). What is checked is what is
# there, not which base this is: Ray's image has Python 3.11 and a `ray` user, the Debian rootfs neither.
set -eu

# gcc and libc6-dev: the CPU kernels compile on first use (-fopenmp: libgomp1). openssl: the gpu overlay's init
# container signs each pod's Ray TLS certificate. wget: KubeRay's default probes on Ray containers run it.
packages="gcc libc6-dev libgomp1 openssl wget ca-certificates"
if ! command -v python3.11 >/dev/null 2>&1; then
    packages="$packages python3.11 python3-pip"
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
# shellcheck disable=SC2086  # a list of package names
apt-get install -y --no-install-recommends $packages
apt-get clean
rm -rf /var/lib/apt/lists/*

if ! python3.11 -m pip --version >/dev/null 2>&1; then
    echo "prepare_base.sh: $(command -v python3.11) has no pip; the base image needs Python 3.11 with pip" >&2
    exit 1
fi
# KubeRay runs its commands through `bash -lc`, and a login shell on Debian takes PATH from /etc/profile: give it the
# base's PATH (its Python's bin first, if it has one there). The Containerfile changes no PATH after this step.
printf 'export PATH="%s"\n' "$PATH" > /etc/profile.d/specdec-path.sh
# uid and gid 1000: the manifests' runAsUser, runAsGroup and fsGroup (k8s/base/rayservice.yaml) name these numbers.
# Ray's images have the user already, as uid 1000 (group 100); the pods run it with group 1000 either way.
if ! id ray >/dev/null 2>&1; then
    groupadd --gid 1000 ray
    useradd --create-home --uid 1000 --gid 1000 --shell /bin/bash ray
fi
