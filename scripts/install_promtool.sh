#!/usr/bin/env bash
# promtool, for the alert rules' tests (tests/k8s/test_alerts.py: `promtool check rules`, `promtool test rules`), from
# Debian's `prometheus` package, where apt-get is. Does nothing where promtool is already on PATH. Elsewhere it says
# what to do and exits 0: `make setup` goes on, and the alert tests fail saying promtool is missing (or skip, with
# SPECDEC_NO_PROMTOOL=1).
#
# The package ships a prometheus service; only promtool is wanted. A policy-rc.d that answers 101 ("action forbidden")
# keeps the maintainer scripts from starting it (invoke-rc.d and deb-systemd-invoke both ask it); an existing one is
# left as it is, one made here is removed after.
set -euo pipefail

if command -v promtool >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "promtool is missing and there is no apt-get here: install Prometheus's promtool yourself" \
       "(https://prometheus.io/download/), or set SPECDEC_NO_PROMTOOL=1 to skip the alert rules' tests" >&2
  exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "promtool is missing and installing it needs root (no sudo here):" \
         "apt-get install --no-install-recommends prometheus" >&2
    exit 0
  fi
  SUDO=(sudo)
fi

POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  "${SUDO[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > $POLICY && chmod 755 $POLICY"
  trap '"${SUDO[@]}" rm -f "$POLICY"' EXIT
fi

export DEBIAN_FRONTEND=noninteractive
install() {
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
}
# An image's package lists may be empty or stale: update once and try again.
install || { "${SUDO[@]}" apt-get update -q && install; }
promtool --version
