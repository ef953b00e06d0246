#!/usr/bin/env bash
# Debian packages the test suite needs: a real Slurm (with slurmdbd + MariaDB for sacct),
# munge, iproute2 for the test cluster's network namespaces. Idempotent; needs root.
set -euo pipefail
pkgs=(slurm-wlm slurm-client slurmdbd mariadb-server munge iproute2 procps)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-system: need root to install: ${missing[*]}" >&2; exit 1
  fi
  echo "install-system: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
