#!/usr/bin/env bash
# `make image`: build specdec's image (k8s/image/Containerfile) with podman, on a Debian base made here or on BASE.
#
# The default base needs no registry: a Debian rootfs made with `debootstrap --variant=minbase` from this machine's
# apt mirror, for this machine's release, kept as a tarball in $IMAGE_CACHE and imported once as a local image. It is
# made again only when both are gone (`make image-clean`). podman keeps the layers above it, so a rebuild redoes only
# what changed (the project's own layer for a code change; torch and the dependencies for a pyproject.toml change).
#
# Settings (environment; the Makefile passes its variables of the same names):
#   IMAGE            the tag to build (specdec:dev, what the cpu-dev overlay runs)
#   BASE             a base image to build on instead, e.g. rayproject/ray:2.60.0-py311-cpu (pulled by podman)
#   TORCH_INDEX_URL  the index to take torch from (CUDA: https://download.pytorch.org/whl/cu128); unset: a torch
#                    wheel this machine's pip finds locally (its find-links), else the CPU index
#   IMAGE_CACHE      where the rootfs tarball is kept (~/.cache/specdec/image)
#   DEBIAN_SUITE, DEBIAN_MIRROR   the rootfs's release and mirror (this machine's, from /etc/os-release and apt)
#   PYTHON           the Python whose pip looks for a local torch wheel (python3.11)
#   CA_BUNDLE        the CA bundle pip trusts in the build (/etc/ssl/certs/ca-certificates.crt; none: an empty one)
#   PODMAN, PODMAN_BUILD_FLAGS    the podman command and extra flags for `podman build`
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-specdec:dev}
PODMAN=${PODMAN:-podman}
PYTHON=${PYTHON:-python3.11}
IMAGE_CACHE=${IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec/image}
read -r -a podman_build_flags <<< "${PODMAN_BUILD_FLAGS:-}"
inputs=build/image   # bind-mounted into the build (see the Containerfile's header); ignored by git

die() { echo "image_build.sh: $*" >&2; exit 1; }
now() { date +%s; }

# The first URI among this machine's apt sources (one-line .list files, deb822 .sources files) that serves the suite
# $1, for binary packages.
apt_source() {
    local suite=$1 file
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $file ]] || continue
        awk -v suite="$suite" '
            $1 == "deb" { i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i + 1) == suite) { print $i; exit } }
        ' "$file"
    done
    for file in /etc/apt/sources.list.d/*.sources; do
        [[ -f $file ]] || continue
        awk -v suite="$suite" '
            function flush() {
                if (!found && deb && served && enabled && uri != "") { print uri; found = 1 }
                deb = served = 0; enabled = 1; uri = ""
            }
            BEGIN { enabled = 1 }
            /^[ \t]*$/ { flush(); next }
            $1 == "Types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
            $1 == "URIs:" { uri = $2 }
            $1 == "Suites:" { for (i = 2; i <= NF; i++) if ($i == suite) served = 1 }
            $1 == "Enabled:" && $2 == "no" { enabled = 0 }
            END { flush() }
        ' "$file"
    done
}

# The Debian rootfs as a tarball in $IMAGE_CACHE: debootstrap minbase, with the release's updates and security
# suites in its apt sources (the Containerfile's apt-get installs from them).
make_rootfs() {
    local suite=$1 tarball=$2 mirror security work
    [[ $(id -u) == 0 ]] || die "debootstrap needs root (run make image as root, or import a rootfs as $base yourself)"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    mirror=${DEBIAN_MIRROR:-$(apt_source "$suite" | head -n 1)}
    [[ -n $mirror ]] || die "no apt source for '$suite' in /etc/apt/sources.list{,.d}: set DEBIAN_MIRROR"
    security=$(apt_source "$suite-security" | head -n 1)
    echo "image_build.sh: debootstrap --variant=minbase $suite from $mirror (security: ${security:-none})"

    mkdir -p "$IMAGE_CACHE"
    work=$(mktemp -d "$IMAGE_CACHE/rootfs.XXXXXX")
    # shellcheck disable=SC2064  # expand now: $work is local
    trap "rm -rf '$work'" EXIT
    local keyring=()
    [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] && keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
    debootstrap --variant=minbase "${keyring[@]}" "$suite" "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
        || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }

    local root=$work/rootfs
    rm -f "$root/etc/apt/sources.list"
    {
        printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\n' "$mirror" "$suite" "$suite"
        printf 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
        [[ -z $security ]] || printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: %s\n' \
            "$security" "$suite" /usr/share/keyrings/debian-archive-keyring.gpg
    } > "$root/etc/apt/sources.list.d/debian.sources"
    # No manuals or translations in an image (copyright notices stay).
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
        > "$root/etc/dpkg/dpkg.cfg.d/specdec-image-nodoc"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/var/log/*.log
    tar --numeric-owner -C "$root" -cf "$work/rootfs.tar" .
    mv "$work/rootfs.tar" "$tarball"
    rm -rf "$work"
    trap - EXIT
}

command -v "$PODMAN" >/dev/null || die "$PODMAN is not installed (apt-get install podman buildah runc)"
start=$(now)

# The base: BASE as given, or the local Debian one (made here if missing).
if [[ -n ${BASE:-} ]]; then
    base=$BASE
else
    # shellcheck disable=SC1091
    suite=${DEBIAN_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
    [[ -n $suite ]] || die "no VERSION_CODENAME in /etc/os-release: set DEBIAN_SUITE (e.g. bookworm)"
    base=localhost/specdec-base:$suite
    if ! "$PODMAN" image exists "$base"; then
        tarball=$IMAGE_CACHE/debian-$suite-minbase.tar
        if [[ ! -f $tarball ]]; then
            make_rootfs "$suite" "$tarball"
            echo "image_build.sh: rootfs $tarball ($(du -h "$tarball" | cut -f1)) in $(( $(now) - start )) s"
        fi
        # Imported once: a new import is a new base image, which would rebuild every layer above it.
        "$PODMAN" import --change 'CMD ["/bin/bash"]' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --message "debootstrap --variant=minbase $suite" "$tarball" "$base" >/dev/null
        echo "image_build.sh: imported $tarball as $base"
    fi
fi

# This machine's build inputs (see the Containerfile's header).
mkdir -p "$inputs/wheels"
ca_bundle=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
if [[ -f $ca_bundle ]]; then cp "$ca_bundle" "$inputs/ca-certificates.crt"; else : > "$inputs/ca-certificates.crt"; fi
torch=$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"') || die "no torch==VERSION in pyproject.toml"
build_args=(--build-arg "BASE=$base")
if [[ -n ${TORCH_INDEX_URL:-} ]]; then
    rm -f "$inputs"/wheels/*.whl
    build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif ! ls "$inputs"/wheels/"torch-${torch#torch==}"[+-]*.whl >/dev/null 2>&1; then
    rm -f "$inputs"/wheels/*.whl
    # The wheel `make setup` installs on this machine: pip's local sources only (--no-index keeps the find-links).
    if "$PYTHON" -m pip download --quiet --no-deps --no-index --only-binary=:all: --dest "$inputs/wheels" "$torch" \
        2>/dev/null; then
        echo "image_build.sh: staged $(basename "$inputs"/wheels/torch-*.whl) from this machine's pip find-links"
    else
        echo "image_build.sh: no local $torch wheel: torch comes from the Containerfile's TORCH_INDEX_URL"
    fi
fi

build_start=$(now)
"$PODMAN" build --file k8s/image/Containerfile --tag "$IMAGE" "${build_args[@]}" "${podman_build_flags[@]}" .
echo "image_build.sh: built $IMAGE on $base in $(( $(now) - build_start )) s ($(( $(now) - start )) s in all)," \
     "$("$PODMAN" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"
