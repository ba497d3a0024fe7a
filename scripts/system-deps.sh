#!/usr/bin/env bash
# System packages every environment of this project needs: liburing's headers (the io_uring layer),
# pkg-config and a C compiler (to build it), fio (benchmark reference), venv and Python headers.
# As root on Debian/Ubuntu they are installed with apt-get; otherwise they are only checked.
set -euo pipefail
PKGS=(liburing-dev pkg-config gcc g++ fio python3-venv python3-dev)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
  if [ ${#need[@]} -gt 0 ]; then
    echo "[setup] apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
elif ! pkg-config --exists liburing 2>/dev/null; then
  echo "[setup] liburing headers missing: run as root, or install liburing-dev pkg-config gcc" \
       "(Debian/Ubuntu) / liburing-devel pkgconf gcc (Fedora/RHEL)" >&2
  exit 1
fi
