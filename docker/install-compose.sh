#!/usr/bin/env bash
# Installs Docker Compose v2 from Debian trixie's docker-compose package, for a Debian or Ubuntu
# host whose own packages have only Compose 1.x (bookworm, jammy). The package is a static Go
# binary. Its checksum comes from trixie's package index, whose checksum comes from the release
# file, whose signature is checked against Debian's archive keyring.
set -euo pipefail
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
arch=$(dpkg --print-architecture)
index="main/binary-$arch/Packages.gz"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
curl -fsSL -o InRelease "$mirror/dists/trixie/InRelease"
gpgv --keyring "$keyring" --output Release InRelease 2>gpgv.log || { cat gpgv.log >&2; exit 1; }
curl -fsSL -o Packages.gz "$mirror/dists/trixie/$index"
index_sum=$(awk -v f="$index" '/^SHA256:/{s=1; next} /^[^ ]/{s=0} s && $3 == f {print $1}' Release)
echo "$index_sum  Packages.gz" | sha256sum -c --quiet
gunzip Packages.gz
entry=$(awk '/^Package: docker-compose$/{p=1} p&&/^$/{exit} p' Packages)
file=$(sed -n 's/^Filename: //p' <<<"$entry")
sum=$(sed -n 's/^SHA256: //p' <<<"$entry")
[ -n "$file" ] && [ -n "$sum" ] || { echo "no docker-compose in trixie's index" >&2; exit 1; }
curl -fsSL -o compose.deb "$mirror/$file"
echo "$sum  compose.deb" | sha256sum -c --quiet
dpkg-deb -x compose.deb root
plugin=$(find root -type f -name docker-compose -perm -u+x | head -1)
install -D -m 0755 "$plugin" /usr/libexec/docker/cli-plugins/docker-compose
docker compose version
