#!/usr/bin/env bash
# `envoy/fleet-certs.sh DIR [NAME=SAN ...]`: a test CA for a fleet's mutual TLS between its
# nodes (docs/fleet.md#mutual-tls), and the certificate every node presents, as client and
# as server:
#   DIR/ca.pem, DIR/ca-key.pem       the fleet's CA (every node trusts it)
#   DIR/node.pem, DIR/node-key.pem   a node's certificate, URI SAN spiffe://holysheep/fleet
# Each NAME=SAN also issues DIR/NAME.pem and DIR/NAME-key.pem from the same CA with that URI
# SAN. Files already there are kept while they have a day left. For production, the certificates come from your own CA
# (cert-manager in deploy/kubernetes/fleet/); these are for the demo and the tests.
set -euo pipefail
dir=$1
shift
mkdir -p "$dir"
cd "$dir"
# Certificates that expire within a day are made again, the CA with them.
for cert in ca.pem node.pem; do
  if [ -f "$cert" ] && ! openssl x509 -checkend 86400 -noout -in "$cert" >/dev/null; then
    rm -f ./*.pem ca.srl
  fi
done
if [ ! -f ca.pem ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca-key.pem -out ca.pem \
    -days 30 -subj "/CN=holysheep fleet test CA" 2>/dev/null
fi
# `issue NAME SAN`: NAME.pem and NAME-key.pem, signed by the CA, for TLS clients and servers.
issue() {
  [ -f "$1.pem" ] && return 0
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1-key.pem" -out "$1.csr" \
    -subj "/CN=$1" 2>/dev/null
  printf 'subjectAltName=URI:%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$2" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -out "$1.pem" -days 30 \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
issue node spiffe://holysheep/fleet
for spec in "$@"; do
  issue "${spec%%=*}" "${spec#*=}"
done
