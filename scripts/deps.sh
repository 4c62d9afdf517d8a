#!/usr/bin/env bash
# Installs the Debian packages moe-dist needs when they are missing: with apt-get when
# run as root, else prints the one command to run. Quiet when everything is present.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libopenmpi-dev openmpi-bin libhwloc-dev
      libprotobuf-c-dev protobuf-c-compiler libinih-dev libcmocka-dev libjansson-dev)
if [ "${1:-}" = "--test" ]; then
  pkgs+=(python3-torch python3-numpy clang)
fi
missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "missing Debian packages; run:" >&2
  echo "  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
