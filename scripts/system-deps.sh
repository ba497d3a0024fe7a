#!/usr/bin/env bash
# System packages every environment of this project needs: liburing's headers (the io_uring layer),
# pkg-config and a C compiler (to build it), fio (benchmark reference), venv and Python headers, bindfs
# (a FUSE mount that maps owners: the owner-mapping case of tests/test_security_shared_tier.py), and
# GlusterFS (server and FUSE client: the reliability suite's real distributed file system, run as root), and
# faketime (libfaketime: another node whose clock differs, test_reliability_dfs_clear.py).
# On Debian/Ubuntu the missing ones are installed with apt-get: directly as root (containers, where
# sudo is often not installed), through sudo for a user who has it. Otherwise they are only checked.
set -euo pipefail
PKGS=(liburing-dev pkg-config gcc g++ fio python3-venv python3-dev bindfs glusterfs-server glusterfs-client faketime)
INSTALL_HINT="install liburing-dev pkg-config gcc fio python3-venv python3-dev bindfs (Debian/Ubuntu) /
liburing-devel pkgconf gcc fio python3-devel bindfs (Fedora/RHEL), or run this as root or as a user with sudo"

need=()
if command -v dpkg >/dev/null && command -v apt-get >/dev/null; then
  for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null; then
    as_root=(sudo)
  else
    as_root=(none)
  fi
  if [ "${as_root[*]}" != none ]; then
    echo "[setup] ${as_root[*]:+${as_root[*]} }apt-get install ${need[*]}"
    ${as_root[@]+"${as_root[@]}"} apt-get update -qq
    ${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    need=()
  fi
fi
if ! pkg-config --exists liburing 2>/dev/null; then
  echo "[setup] liburing headers missing (the io_uring layer cannot be built): $INSTALL_HINT" >&2
  exit 1
fi
if [ ${#need[@]} -gt 0 ]; then  # not root, no sudo: the build can go on; say what else is missing
  echo "[setup] warning: not installed: ${need[*]} (no root, no sudo); $INSTALL_HINT" >&2
fi
